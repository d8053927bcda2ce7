"""The jitted step over the unified pool: `step(params, pool, inputs) -> (pool, results)`.

`pool` is a list, one array per layer, of shape [pages, 2, page_size, W] (see layout.py). It is
donated, so KV writes land in place. The step reads adapters straight from their pages and
samples on the device; one [S, 2] float32 array (token, logprob) comes back to the host.

The "xla" backends here are plain jnp: correct everywhere, and the baseline the kernels beat.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from slora_jax import model
from slora_jax.config import ModelConfig
from slora_jax.sampling import sample


@flax.struct.dataclass
class LoraInputs:
    """The batch's distinct adapters (slots), padded to a bucket of Sa slots and rank R.

    rows[module] = (A rows [Sa, RA], B rows [Sa, RB]): row indices into a layer's row view of the
    pool, RA = ceil(R * in / W); ranks[module] [Sa] (0: the adapter does not target the module).
    token_slot [T]: the slot of each token's adapter, -1 for base-model tokens.
    """
    token_slot: jax.Array
    rows: dict
    ranks: dict
    max_rank: int = flax.struct.field(pytree_node=False)


@flax.struct.dataclass
class StepInputs:
    tokens: jax.Array       # [T] int32
    positions: jax.Array    # [T]
    kv_slot: jax.Array      # [T] page * page_size + offset where the token's K/V go (0: null page)
    token_seq: jax.Array    # [T] sequence row of each token
    page_table: jax.Array   # [S, P]
    seq_lens: jax.Array     # [S] context length once this step's tokens are written
    sample_idx: jax.Array   # [S] token whose logits each sequence samples from
    temperature: jax.Array  # [S]
    top_k: jax.Array        # [S]
    top_p: jax.Array        # [S]
    seeds: jax.Array        # [S] uint32
    steps: jax.Array        # [S] tokens generated so far (folds into the row's PRNG key)
    lora: LoraInputs | None
    decode: bool = flax.struct.field(pytree_node=False)  # one token per sequence, token i is seq i


def empty_pool(cfg: ModelConfig, num_pages: int, page_size: int, dtype) -> list[jax.Array]:
    shape = (num_pages, 2, page_size, cfg.kv_size)
    return [jnp.zeros(shape, dtype) for _ in range(cfg.num_hidden_layers)]


def page_bytes(cfg: ModelConfig, page_size: int, dtype) -> int:
    return cfg.num_hidden_layers * 2 * page_size * cfg.kv_size * jnp.dtype(dtype).itemsize


@functools.partial(jax.jit, donate_argnums=0)
def write_rows(pool: list[jax.Array], rows: jax.Array, data: jax.Array) -> list[jax.Array]:
    """Scatter an adapter's packed rows data [L, n, W] into every layer at row indices [n]."""
    out = []
    for layer, p in enumerate(pool):
        flat = p.reshape(-1, p.shape[-1]).at[rows].set(data[layer].astype(p.dtype))
        out.append(flat.reshape(p.shape))
    return out


# ---------------------------------------------------------------------------------------------
# Attention over the pool (xla).


def paged_attention_xla(q, pool_layer, inp: StepInputs, num_kv_heads: int):
    """q [T, nh, d] against each token's sequence context in the pool."""
    s, p = inp.page_table.shape
    ps = pool_layer.shape[2]
    d = q.shape[-1]
    kv = pool_layer[inp.page_table]  # [S, P, 2, ps, W]
    k = kv[:, :, 0].reshape(s, p * ps, num_kv_heads, d)
    v = kv[:, :, 1].reshape(s, p * ps, num_kv_heads, d)
    ctx = jnp.arange(p * ps)
    if inp.decode:
        mask = (ctx[None, :] < inp.seq_lens[:, None])[:, None, :]  # [S, 1, C]
        return model.attention_scores_softmax(q[:, None], k, v, mask)[:, 0]
    # Packed prefill: every token against every sequence's context, masked to its own, causally.
    t = q.shape[0]
    mask = (inp.token_seq[:, None, None] == jnp.arange(s)[None, :, None]) & \
           (ctx[None, None, :] <= inp.positions[:, None, None])  # [T, S, C]
    o = model.attention_scores_softmax(q[None], k.reshape(1, s * p * ps, num_kv_heads, d),
                                       v.reshape(1, s * p * ps, num_kv_heads, d),
                                       mask.reshape(1, t, s * p * ps))
    return o[0]


def paged_attend(inp: StepInputs, cfg: ModelConfig):
    def attend(layer, q, k, v, pool):
        pl = pool[layer]
        ps = pl.shape[2]
        page, off = inp.kv_slot // ps, inp.kv_slot % ps
        pl = pl.at[page, 0, off].set(k.reshape(k.shape[0], -1).astype(pl.dtype))
        pl = pl.at[page, 1, off].set(v.reshape(v.shape[0], -1).astype(pl.dtype))
        o = paged_attention_xla(q, pl, inp, cfg.num_key_value_heads)
        pool = list(pool)
        pool[layer] = pl
        return o, pool
    return attend


# ---------------------------------------------------------------------------------------------
# LoRA over the pool (xla): gather each slot's A and B rows, one-hot over slots per token.


def lora_xla(x, pool_layer, a_rows, b_rows, ranks, token_slot, max_rank: int, fin: int, fout: int):
    width = pool_layer.shape[-1]
    rows = pool_layer.reshape(-1, width)
    sa = a_rows.shape[0]
    a = rows[a_rows].reshape(sa, -1)[:, :max_rank * fin].reshape(sa, max_rank, fin)
    b = rows[b_rows].reshape(sa, -1)[:, :max_rank * fout].reshape(sa, max_rank, fout)
    live = (jnp.arange(max_rank)[None, :] < ranks[:, None])  # [Sa, R]
    sel = token_slot[:, None] == jnp.arange(sa)[None, :]      # [T, Sa]
    xa = jnp.einsum("ti,sri->tsr", x, a, preferred_element_type=jnp.float32)
    xa = jnp.where(sel[:, :, None] & live[None], xa, 0.0).astype(x.dtype)
    return jnp.einsum("tsr,sro->to", xa, b, preferred_element_type=jnp.float32)


def pool_lora(lora: LoraInputs, cfg: ModelConfig):
    def delta(layer, module, x, pool):
        if module not in lora.rows:
            return None
        a_rows, b_rows = lora.rows[module]
        fin, fout = cfg.module_shape(module)
        return lora_xla(x, pool[layer], a_rows, b_rows, lora.ranks[module], lora.token_slot,
                        lora.max_rank, fin, fout)
    return delta


# ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("pool",))
def step(params, pool, inp: StepInputs, *, cfg: ModelConfig):
    lora = pool_lora(inp.lora, cfg) if inp.lora is not None else None
    h, pool = model.forward(params, cfg, inp.tokens, inp.positions, paged_attend(inp, cfg), pool, lora)
    logits = model.lm_logits(params, cfg, h[inp.sample_idx])
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.PRNGKey(s), n))(inp.seeds, inp.steps)
    tokens, logprobs = sample(logits, inp.temperature, inp.top_k, inp.top_p, keys)
    results = jnp.stack([tokens.astype(jnp.float32), logprobs], axis=-1)  # exact: ids < 2**24
    return pool, results


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("pool",))
def step_all_logits(params, pool, inp: StepInputs, *, cfg: ModelConfig):
    """A prefill step that returns the logits of every token (scoring; tests)."""
    lora = pool_lora(inp.lora, cfg) if inp.lora is not None else None
    h, pool = model.forward(params, cfg, inp.tokens, inp.positions, paged_attend(inp, cfg), pool, lora)
    return pool, model.lm_logits(params, cfg, h)


def rows_needed(rank: int, features: int, width: int) -> int:
    return -(-rank * features // width)


def np_ceil_pow2(n: int, lo: int = 1) -> int:
    return max(lo, 1 << max(0, int(np.ceil(np.log2(max(n, 1))))))
