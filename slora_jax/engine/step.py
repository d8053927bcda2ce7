"""The jitted step over the unified pool: `step(params, pool, inputs) -> (pool, results)`.

`pool` is a list, one array per layer, of shape [pages, 2, page_size, W] (see layout.py). The
step is two jits: `forward_sample` only reads the pool, `commit_kv` only writes this step's K/V
into it, donated, so the writes land in place. The step reads adapters straight from their pages and
samples on the device; one [S, 2] float32 array (token, logprob) comes back to the host.

Attention over the pool and the K/V writes are in attention.py, the step's inputs are built on
the host by inputs.py. The "xla" backends are plain jnp: correct everywhere, and the reference
the kernels are tested against.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from slora_jax.engine.attention import commit_kv, commit_kv_tp, paged_attend
from slora_jax.engine.prompt_logprobs import PromptLogprobInputs, score as score_prompt
from slora_jax.lora import LoraInputs, pool_lora
from slora_jax.model import llama as model
from slora_jax.model import tp as tp_mod
from slora_jax.model.config import ModelConfig
from slora_jax.sampling import SamplingExtras, sample, top_logprobs


@flax.struct.dataclass
class StepInputs:
    tokens: jax.Array       # [T] int32
    positions: jax.Array    # [T]
    kv_slot: jax.Array      # [T] page * page_size + offset where the token's K/V go (0: null page)
    token_seq: jax.Array    # [T] sequence row of each token (-1: padding)
    page_table: jax.Array   # [S, P]
    ctx_lens: jax.Array     # [S] tokens of each sequence already in the pool before this step
    sample_idx: jax.Array   # [S] token whose logits each sequence samples from
    temperature: jax.Array  # [S]
    top_k: jax.Array        # [S]
    top_p: jax.Array        # [S]
    seeds: jax.Array        # [S] uint32
    steps: jax.Array        # [S] tokens generated so far (folds into the row's PRNG key)
    lora: LoraInputs | None
    decode: bool = flax.struct.field(pytree_node=False)  # one token per sequence, token i is seq i
    attention_backend: str = flax.struct.field(pytree_node=False, default="xla")
    # Packed prefill: False when no sequence has context in the pool yet (every chunk starts its
    # prompt), so attention skips the pooled keys; key_window > 0: a query block attends only to
    # the key_window new tokens before it and its own (no chunk is longer than key_window).
    prefill_context: bool = flax.struct.field(pytree_node=False, default=True)
    key_window: int = flax.struct.field(pytree_node=False, default=0)
    # Packed prefill with context (prefill_context): the pool pages of every sequence's context,
    # one sequence after another: ctx_pages [K] their ids, ctx_page_seq [K] the sequence row of
    # each (-1: padding), ctx_page_fill [K] the context tokens each holds (page_size but on a
    # sequence's last page). K is a bucket of the whole step's context, not of its rows times its
    # longest context, so steps with context take few shapes (StepInputBuilder.context_pages).
    # Prefill steps leave page_table and ctx_lens to decode (one null column, zeros).
    ctx_pages: jax.Array | None = None
    ctx_page_seq: jax.Array | None = None
    ctx_page_fill: jax.Array | None = None
    # Async scheduling (EngineConfig.async_scheduling): the step is dispatched before the previous
    # one's tokens reach the host. token_src [T]: row of prev_results whose token is token t's
    # (-1: tokens[t] holds it); prev_results [R, 2]: the previous step's results, padded to R rows,
    # still on the device. The step's own results then come padded to R rows too.
    token_src: jax.Array | None = None
    prev_results: jax.Array | None = None
    # Penalties, logit_bias, min_tokens, min_p, top logprobs: present only when some row of the
    # step asks for one (None: the plain sampler, the step every other batch runs).
    sampling: SamplingExtras | None = None
    # Prompt logprobs (prompt_logprobs.py): present only in a prefill step where some request asks
    # for them (None: the plain step).
    prompt_logprobs: PromptLogprobInputs | None = None


def empty_pool(cfg: ModelConfig, num_pages: int, page_size: int, dtype, tp=None) -> list[jax.Array]:
    """Zeroed pool arrays, committed to the device now: an uncommitted array becomes committed at
    the first adapter load, and every step compiled before that would compile again. tp (a
    tp.TP): each layer split along W over its mesh."""
    shape = (num_pages, 2, page_size, cfg.kv_size)
    sharding = tp.sharding(tp_mod.POOL) if tp is not None else jax.sharding.SingleDeviceSharding(jax.devices()[0])
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return [zeros() for _ in range(cfg.num_hidden_layers)]


def page_bytes(cfg: ModelConfig, page_size: int, dtype) -> int:
    return cfg.num_hidden_layers * 2 * page_size * cfg.kv_size * jnp.dtype(dtype).itemsize


def max_pool_pages(cfg: ModelConfig, page_size: int, tensor_parallel: int = 1) -> int:
    """The most pages a pool layer holds with its elements on one device below 2**31: the GPU
    kernels (paged attention, the LoRA kernels) compute element offsets into a layer in int32, and
    a small model on a large GPU would otherwise size a pool past that from its memory."""
    per_page = 2 * page_size * cfg.kv_size // tensor_parallel
    return (2**31 - 1) // per_page


@functools.partial(jax.jit, donate_argnums=0)
def write_rows(pool: list[jax.Array], rows: jax.Array, data: jax.Array) -> list[jax.Array]:
    """Scatter an adapter's packed rows data [L, n, W] into every layer at row indices [n]."""
    out = []
    for layer, p in enumerate(pool):
        flat = p.reshape(-1, p.shape[-1]).at[rows].set(data[layer].astype(p.dtype))
        out.append(flat.reshape(p.shape))
    return out


def load_rows(pool: list[jax.Array], rows: np.ndarray, data) -> list[jax.Array]:
    """Page an adapter in: copy its rows [L, n, W] (numpy, or staged in pinned host memory) to the
    device (asynchronous), pad n to a power of two (the padding writes into the null page, so
    few scatter shapes get compiled) and scatter them into their pages."""
    n = max(64, 1 << (len(rows) - 1).bit_length())
    idx = np.zeros(n, np.int32)
    idx[:len(rows)] = rows
    sharding = pool[0].sharding
    if isinstance(sharding, jax.sharding.NamedSharding):  # a pool split along W (tensor parallel)
        sharding = jax.sharding.NamedSharding(sharding.mesh, tp_mod.ROWS)
    data = jax.device_put(data, sharding)
    if n != len(rows):
        data = jnp.pad(data, ((0, 0), (0, n - len(rows)), (0, 0)))
    return write_rows(pool, idx, data)


# ---------------------------------------------------------------------------------------------


def _tokens(inp: StepInputs):
    """The step's input tokens: the host's, and those fed from the previous step's results."""
    if inp.token_src is None:
        return inp.tokens
    fed = inp.prev_results[jnp.maximum(inp.token_src, 0), 0].astype(jnp.int32)
    return jnp.where(inp.token_src >= 0, fed, inp.tokens)


def _pad_results(results, inp: StepInputs):
    """Async scheduling: results padded to prev_results' rows, so the next step can read them."""
    if inp.prev_results is None:
        return results
    return jnp.zeros(inp.prev_results.shape, results.dtype).at[:results.shape[0]].set(results)


def _forward(params, pool, inp: StepInputs, cfg: ModelConfig, tp: int = 1):
    """tp > 1: one device's share under shard_map (forward_sample_tp), cfg the whole model's."""
    lora = pool_lora(inp.lora, cfg, pool, tp) if inp.lora is not None else None
    shapes, reduce = (cfg, {}) if tp == 1 else (tp_mod.local_config(cfg, tp), {"reduce": tp_mod.psum})
    h, (_, new_kv) = model.forward(params, shapes, _tokens(inp), inp.positions, paged_attend(inp),
                                   (pool, ()), lora, **reduce)
    return h, new_kv


def _sample_rows(params, cfg: ModelConfig, h_rows, inp: StepInputs):
    """Sample each sequence's next token from its final-normed hidden row: [S, 2] (token, logprob),
    and with inp.sampling.top_logprobs the rows' top logprobs [S, 2, k] (else None)."""
    logits = model.lm_logits(params, cfg, h_rows)
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.PRNGKey(s), n))(inp.seeds, inp.steps)
    extras = inp.sampling
    fed = _tokens(inp)[inp.sample_idx] if extras is not None and extras.history is not None else None
    tokens, logprobs = sample(logits, inp.temperature, inp.top_k, inp.top_p, keys, extras, fed)
    results = jnp.stack([tokens.astype(jnp.float32), logprobs], axis=-1)  # exact: ids < 2**24
    top = top_logprobs(logits, extras.top_logprobs) if extras is not None and extras.top_logprobs else None
    return results, top


def _forward_sample(params, pool, inp: StepInputs, cfg: ModelConfig, tp: int = 1):
    """(new K/V, results), results being (results, top logprobs, prompt logprobs) when the step
    returns either of the last two (each None when not asked for)."""
    h, new_kv = _forward(params, pool, inp, cfg, tp)
    results, top = _sample_rows(params, cfg, h[inp.sample_idx], inp)
    results = _pad_results(results, inp)
    prompt = score_prompt(params, cfg, h, inp.prompt_logprobs) if inp.prompt_logprobs is not None else None
    return new_kv, results if top is None and prompt is None else (results, top, prompt)


@functools.partial(jax.jit, static_argnames=("cfg",))
def forward_sample(params, pool, inp: StepInputs, *, cfg: ModelConfig):
    """Everything that reads the pool: the forward pass and the sampler."""
    return _forward_sample(params, pool, inp, cfg)


# Tensor parallel (slora_jax.model.tp): the same two jits under shard_map over the mesh's "tp" axis.
# Each device runs the forward pass on its weights, heads and pool columns; the hidden state is
# whole on every device after each layer's sums, so every device samples the same rows (the
# results are replicated).

@functools.partial(jax.jit, static_argnames=("cfg", "tp"))
def forward_sample_tp(params, pool, inp: StepInputs, *, cfg: ModelConfig, tp):
    return _over_mesh(functools.partial(_forward_sample, cfg=cfg, tp=tp.size), tp, params, pool, inp)


def _over_mesh(local, tp, params, pool, inp: StepInputs):
    """local(params, pool, inp) -> (new K/V, replicated output) under shard_map over tp's mesh."""
    kv = tuple((tp_mod.KV, tp_mod.KV) for _ in pool)
    return jax.shard_map(local, mesh=tp.mesh, check_vma=False,
                         in_specs=(tp_mod.param_specs(params), [tp_mod.POOL] * len(pool), tp_mod.REPLICATED),
                         out_specs=(kv, tp_mod.REPLICATED))(params, pool, inp)


def step(params, pool, inp: StepInputs, *, cfg: ModelConfig, tp=None):
    """One engine step: `(pool, results)`; the pool is donated (updated in place). tp (a tp.TP):
    the step split over its mesh (params and pool placed for it). results is the [S, 2] array, or
    (that array, top logprobs [S, 2, k] or None, prompt logprobs [R, 2 + 2k] or None) for a step
    with inp.sampling.top_logprobs or inp.prompt_logprobs."""
    if tp is not None:
        new_kv, results = forward_sample_tp(params, pool, inp, cfg=cfg, tp=tp)
        return commit_kv_tp(pool, new_kv, inp.kv_slot, tp=tp), results
    new_kv, results = forward_sample(params, pool, inp, cfg=cfg)
    return commit_kv(pool, new_kv, inp.kv_slot), results


@functools.partial(jax.jit, static_argnames=("cfg", "tp"))
def _all_logits(params, pool, inp: StepInputs, *, cfg: ModelConfig, tp=None):
    def local(params, pool, inp):
        h, new_kv = _forward(params, pool, inp, cfg, tp.size if tp is not None else 1)
        return new_kv, model.lm_logits(params, cfg, h)
    return local(params, pool, inp) if tp is None else _over_mesh(local, tp, params, pool, inp)


def step_all_logits(params, pool, inp: StepInputs, *, cfg: ModelConfig, tp=None):
    """A prefill step that returns the logits of every token (scoring; tests)."""
    new_kv, logits = _all_logits(params, pool, inp, cfg=cfg, tp=tp)
    if tp is not None:
        return commit_kv_tp(pool, new_kv, inp.kv_slot, tp=tp), logits
    return commit_kv(pool, new_kv, inp.kv_slot), logits

