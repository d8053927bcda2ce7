"""The jitted step over the unified pool: `step(params, pool, inputs) -> (pool, results)`.

`pool` is a list, one array per layer, of shape [pages, 2, page_size, W] (see layout.py). The
step is two jits: `forward_sample` only reads the pool, `commit_kv` only writes this step's K/V
into it, donated, so the writes land in place. The step reads adapters straight from their pages and
samples on the device; one [S, 2] float32 array (token, logprob) comes back to the host.

The "xla" backends here are plain jnp: correct everywhere, and the baseline the kernels beat.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention import paged_decode_attention
from slora_jax.lora import (QKV, LoraInputs, lora_xla, lora_xla_expand, lora_xla_shrink,  # noqa: F401 (re-exported)
                            pool_lora, qkv_group, rows_needed, stack_qkv)
from slora_jax.model import llama as model
from slora_jax.model import tp as tp_mod
from slora_jax.model.config import ModelConfig
from slora_jax.sampling import sample


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
    # Queries per block of the xla packed prefill attention: bounds its [heads, block, keys] scores.
    query_block: int = flax.struct.field(pytree_node=False, default=512)
    # Packed prefill: False when no sequence has context in the pool yet (every chunk starts its
    # prompt), so attention skips the pooled keys; key_window > 0: a query block attends only to
    # the key_window new tokens before it and its own (no chunk is longer than key_window).
    prefill_context: bool = flax.struct.field(pytree_node=False, default=True)
    key_window: int = flax.struct.field(pytree_node=False, default=0)
    # Packed prefill with context: the rows of page_table and ctx_lens are only the sequences that
    # have context, ctx_seq [C] their sequence rows (-1: padding). None: row i is sequence i.
    ctx_seq: jax.Array | None = None
    # Overlapped steps (EngineOptions.overlap_steps): the step is dispatched before the previous
    # one's tokens reach the host. token_src [T]: row of prev_results whose token is token t's
    # (-1: tokens[t] holds it); prev_results [R, 2]: the previous step's results, padded to R rows,
    # still on the device. The step's own results then come padded to R rows too.
    token_src: jax.Array | None = None
    prev_results: jax.Array | None = None


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
    """The most pages a pool layer holds with its elements on one device below 2**31: the Triton
    kernels (paged attention, the LoRA pairs) compute element offsets into a layer in int32. A
    tiny model on an H200 would otherwise size a pool of ~12e9 elements a layer from the free
    memory (session 26's GPU parity run)."""
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
# Attention over the pool (xla).


def paged_attention_xla(q, k, v, pool_layer, inp: StepInputs):
    """q, k, v [T, heads, d]: this step's tokens. Each token attends to its sequence's context
    already in the pool (positions < ctx_lens) and, causally, to this step's tokens of the same
    sequence. The pool is only read here: the step writes this step's K/V after every read, so
    the donated pool is updated in place (see commit_kv)."""
    s, p = inp.page_table.shape
    ps = pool_layer.shape[2]
    kvh, d = k.shape[1], k.shape[2]
    if inp.decode or inp.prefill_context:  # a fresh-prompt prefill step reads no pooled page
        kv = pool_layer[inp.page_table]  # [S, P, 2, ps, W]
        pk = kv[:, :, 0].reshape(s, p * ps, kvh, d)
        pv = kv[:, :, 1].reshape(s, p * ps, kvh, d)
        in_ctx = jnp.arange(p * ps)[None, :] < inp.ctx_lens[:, None]  # [S, C]
    if inp.decode:  # token i is sequence i
        keys = jnp.concatenate([pk, k[:, None]], axis=1)
        vals = jnp.concatenate([pv, v[:, None]], axis=1)
        mask = jnp.concatenate([in_ctx, jnp.ones((s, 1), bool)], axis=1)[:, None, :]
        return model.attention_scores_softmax(q[:, None], keys, vals, mask)[:, 0]
    # Packed prefill: every token against every sequence's pooled context and every new token,
    # masked to its own sequence (and causally among the new tokens).
    # The queries go in blocks (a loop), so the scores of one block [heads, block, keys] are alive
    # at a time: at 4096 tokens x 32 sequences x 32 pages, all queries at once took 20 GiB. Pooled
    # keys are left out when no sequence has context yet, and with a key window a block reads only
    # the new tokens that can be in its sequences: [start - key_window, end).
    t = q.shape[0]
    tb = min(t, inp.query_block)
    if t % tb:
        tb = t
    span = tb + inp.key_window
    windowed = 0 < inp.key_window and tb < t and span < t
    ctx_keys = s * p * ps if inp.prefill_context else 0
    if inp.prefill_context:
        pooled_k, pooled_v = pk.reshape(ctx_keys, kvh, d), pv.reshape(ctx_keys, kvh, d)

    def block(args):
        qb, seq_b, pos_b, b = args
        if windowed:
            lo = jnp.clip(b * tb - inp.key_window, 0, t - span)
            kn, vn = jax.lax.dynamic_slice_in_dim(k, lo, span), jax.lax.dynamic_slice_in_dim(v, lo, span)
            seq_k = jax.lax.dynamic_slice_in_dim(inp.token_seq, lo, span)
            pos_k = jax.lax.dynamic_slice_in_dim(inp.positions, lo, span)
        else:
            kn, vn, seq_k, pos_k = k, v, inp.token_seq, inp.positions
        mask = (seq_b[:, None] == seq_k[None, :]) & (pos_k[None, :] <= pos_b[:, None])  # [B, keys]
        keys, vals = kn, vn
        if inp.prefill_context:
            rows = jnp.arange(s) if inp.ctx_seq is None else inp.ctx_seq
            same = seq_b[:, None] == rows[None, :]                                       # [B, S]
            ctx_mask = (same[:, :, None] & in_ctx[None]).reshape(qb.shape[0], ctx_keys)
            mask = jnp.concatenate([ctx_mask, mask], axis=1)
            keys, vals = jnp.concatenate([pooled_k, kn], axis=0), jnp.concatenate([pooled_v, vn], axis=0)
        return model.attention_scores_softmax(qb[None], keys[None], vals[None], mask[None])[0]

    if tb == t:
        return block((q, inp.token_seq, inp.positions, 0))
    nb = t // tb
    out = jax.lax.map(block, (q.reshape(nb, tb, *q.shape[1:]), inp.token_seq.reshape(nb, tb),
                              inp.positions.reshape(nb, tb), jnp.arange(nb)))
    return out.reshape(q.shape)


def write_kv(pool_layer, k, v, kv_slot):
    k, v = k[:kv_slot.shape[0]], v[:kv_slot.shape[0]]  # a StepBuffers K/V buffer has rows to spare
    ps = pool_layer.shape[2]
    page, off = kv_slot // ps, kv_slot % ps
    pool_layer = pool_layer.at[page, 0, off].set(k.reshape(k.shape[0], -1).astype(pool_layer.dtype))
    return pool_layer.at[page, 1, off].set(v.reshape(v.shape[0], -1).astype(pool_layer.dtype))


def paged_attend(inp: StepInputs):
    """Attention reads the pool; each layer's new K/V is returned and written by `commit_kv`."""
    def attend(layer, q, k, v, state):
        pool, pending = state
        if inp.decode and inp.attention_backend == "pallas":
            o = paged_decode_attention(q, k, v, pool[layer], inp.page_table, inp.ctx_lens)
        else:  # prefill has no kernel yet: xla
            o = paged_attention_xla(q, k, v, pool[layer], inp)
        return o, (pool, pending + ((k, v),))
    return attend


def _write_kv_all(pool: list[jax.Array], new_kv, kv_slot: jax.Array) -> list[jax.Array]:
    return [write_kv(pl, k, v, kv_slot) for pl, (k, v) in zip(pool, new_kv)]


@functools.partial(jax.jit, donate_argnums=0)
def commit_kv(pool: list[jax.Array], new_kv, kv_slot: jax.Array) -> list[jax.Array]:
    """Write every layer's new K/V [T, kv_heads, d] at kv_slot [T]. A jit of its own that only
    scatters into the donated pool, so XLA updates it in place on every backend; inside the
    step, where the same buffers are also gathered from, XLA on GPU copied them instead."""
    return _write_kv_all(pool, new_kv, kv_slot)


# ---------------------------------------------------------------------------------------------


def _tokens(inp: StepInputs):
    """The step's input tokens: the host's, and those fed from the previous step's results."""
    if inp.token_src is None:
        return inp.tokens
    fed = inp.prev_results[jnp.maximum(inp.token_src, 0), 0].astype(jnp.int32)
    return jnp.where(inp.token_src >= 0, fed, inp.tokens)


def _pad_results(results, inp: StepInputs):
    """Overlapped steps: results padded to prev_results' rows, so the next step can read them."""
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
    """Sample each sequence's next token from its final-normed hidden row: [S, 2] (token, logprob)."""
    logits = model.lm_logits(params, cfg, h_rows)
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.PRNGKey(s), n))(inp.seeds, inp.steps)
    tokens, logprobs = sample(logits, inp.temperature, inp.top_k, inp.top_p, keys)
    return jnp.stack([tokens.astype(jnp.float32), logprobs], axis=-1)  # exact: ids < 2**24


def _forward_sample(params, pool, inp: StepInputs, cfg: ModelConfig, tp: int = 1):
    h, new_kv = _forward(params, pool, inp, cfg, tp)
    return new_kv, _pad_results(_sample_rows(params, cfg, h[inp.sample_idx], inp), inp)


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


@functools.partial(jax.jit, static_argnames=("tp",), donate_argnums=0)
def commit_kv_tp(pool: list[jax.Array], new_kv, kv_slot: jax.Array, *, tp) -> list[jax.Array]:
    """commit_kv on each device's columns of the pool and its heads' K/V."""
    specs, kv = [tp_mod.POOL] * len(pool), tuple((tp_mod.KV, tp_mod.KV) for _ in pool)
    return jax.shard_map(_write_kv_all, mesh=tp.mesh, in_specs=(specs, kv, tp_mod.REPLICATED), out_specs=specs,
                         check_vma=False)(pool, new_kv, kv_slot)


# The same forward pass as one small jit per layer kind instead of one jit over the unrolled
# model: a new step shape then compiles one decoder layer (shared by every layer: same shapes,
# other arrays), not num_hidden_layers copies of it, at the price of a dispatch per layer.

@functools.partial(jax.jit, static_argnames=("cfg",))
def embed_step(embed_tokens, inp: StepInputs, *, cfg: ModelConfig):
    cos, sin = model.rope_cos_sin(cfg, inp.positions)
    return embed_tokens[_tokens(inp)], cos, sin


@functools.partial(jax.jit, static_argnames=("cfg",))
def layer_step(layers_params: tuple, pool_layers: tuple, x, cos, sin, inp: StepInputs, *, cfg: ModelConfig):
    """A run of consecutive decoder layers, each over its own pool array (read only): (x, their
    new (k, v) in order). Every run of the same length shares one executable."""
    news = []
    for layer_params, pool_layer in zip(layers_params, pool_layers):
        pool = [pool_layer]  # each layer is "layer 0" of a one-layer pool for the callbacks
        lora = pool_lora(inp.lora, cfg, pool) if inp.lora is not None else None
        x, (_, new) = model.decoder_layer(cfg, layer_params, 0, x, cos, sin, paged_attend(inp), (pool, ()), lora)
        news.append(new[0])
    return x, tuple(news)


@functools.partial(jax.jit, static_argnames=("cfg",))
def head_step(head, x, inp: StepInputs, *, cfg: ModelConfig):
    h = model.rms_norm(x[inp.sample_idx], head["norm"], cfg.rms_norm_eps)  # row-wise: rows first
    return _pad_results(_sample_rows(head, cfg, h, inp), inp)


def forward_sample_per_layer(params, pool, inp: StepInputs, *, cfg: ModelConfig, layers_per_call: int = 1):
    """forward_sample's result through embed_step, layer_step over each run of layers_per_call
    layers (the last run may be shorter) and head_step."""
    inp = jax.device_put(inp, pool[0].sharding)  # once (not per layer), on the pool's device
    x, cos, sin = embed_step(params["embed_tokens"], inp, cfg=cfg)
    new_kv = []
    layers = params["layers"]
    for i, n in _layer_runs(len(layers), layers_per_call):
        x, kv = layer_step(tuple(layers[i:i + n]), tuple(pool[i:i + n]), x, cos, sin, inp, cfg=cfg)
        new_kv.extend(kv)
    return tuple(new_kv), head_step(_head(params), x, inp, cfg=cfg)


def _layer_runs(num_layers: int, layers_per_call: int) -> list[tuple[int, int]]:
    """(first layer, length) of each run of layers one layer_step call takes."""
    k = max(1, layers_per_call)
    return [(i, min(k, num_layers - i)) for i in range(0, num_layers, k)]


def _head(params) -> dict:
    return {k: params[k] for k in ("norm", "embed_tokens", "lm_head") if k in params}


def compile_layer_steps(params, pool, inp: StepInputs, *, cfg: ModelConfig, layers_per_call: int = 1) -> None:
    """Compile forward_sample_per_layer's jits for inp's shapes without running a decoder layer (a
    warm-up thread's work). embed_step runs, so the layers are lowered with the very arrays (and
    placements) a step passes them, and the step's own calls then find them compiled."""
    inp = jax.device_put(inp, pool[0].sharding)
    x, cos, sin = embed_step(params["embed_tokens"], inp, cfg=cfg)
    layers = params["layers"]
    for n in sorted({n for _, n in _layer_runs(len(layers), layers_per_call)}):
        layer_step.lower(tuple(layers[:n]), tuple(pool[:n]), x, cos, sin, inp, cfg=cfg).compile()
    head_step.lower(_head(params), x, inp, cfg=cfg).compile()


def device_inputs(inp: StepInputs, sharding) -> StepInputs:
    """The step's host-built arrays (numpy, 4-byte dtypes) on the device in one host-to-device
    copy: packed into one int32 buffer (pack_inputs), put, and split by a small jit
    (EngineOptions.pack_inputs), instead of one copy per array inside the step's call (~40 with
    adapters). Other leaves (the previous step's results, already on the device) pass through."""
    buf, device, spec = pack_inputs(inp)
    if not buf.size:
        return inp
    host, device = iter(_host_leaves(jax.device_put(buf, sharding), spec=spec)), iter(device)
    return jax.tree_util.tree_unflatten(spec.treedef, [next(host) if m[0] == "h" else next(device)
                                                       for m in spec.leaves])


@functools.partial(jax.jit, static_argnames=("spec",))
def _host_leaves(buf, *, spec):
    return [_host_leaf(buf, m) for m in spec.leaves if m[0] == "h"]


def step(params, pool, inp: StepInputs, *, cfg: ModelConfig, per_layer: int = 0, tp=None):
    """One engine step: `(pool, results)`; the pool is donated (updated in place). per_layer = k
    >= 1 (True: 1): through forward_sample_per_layer, k decoder layers a jit (see
    EngineOptions.compile_per_layer and layers_per_call); 0: one jit over the unrolled model.
    tp (a tp.TP): the whole-model step split over its mesh (params and pool placed for it).
    (step_packed: the same step through StepBuffers.)"""
    if tp is not None:
        new_kv, results = forward_sample_tp(params, pool, inp, cfg=cfg, tp=tp)
        return commit_kv_tp(pool, new_kv, inp.kv_slot, tp=tp), results
    if per_layer:
        new_kv, results = forward_sample_per_layer(params, pool, inp, cfg=cfg, layers_per_call=int(per_layer))
    else:
        new_kv, results = forward_sample(params, pool, inp, cfg=cfg)
    return commit_kv(pool, new_kv, inp.kv_slot), results


# Stable device addresses for the step (StepBuffers). XLA runs a whole-model step as CUDA graphs
# (command buffers) and, before each launch, updates every graph node whose buffers moved since
# the last launch. A step's fresh inputs (~40 new arrays every step) and its new K/V (64 fresh
# outputs on llama-7b) move every time, and the node updates cost the host milliseconds a step
# (bench/dispatch_probe.py, H200, S2's decode step: ~2.9 ms of command-buffer update a call; ~780
# of ~875 commands updated). With EngineOptions.stable_buffers the engine packs each step's
# host-built inputs into one buffer, copies it into a persistent device buffer of its size (one
# transfer, one small in-place copy), and the step unpacks its inputs from there and writes its
# new K/V and sampled rows into persistent donated buffers: the big graph sees the same addresses
# every step (measured before the results ring: ~1 ms a call of command-buffer walk was left, for
# the fresh results array).


@dataclasses.dataclass(frozen=True)
class PackSpec:
    """How a StepInputs was packed (hashable: a static jit argument): its tree, and per leaf
    ("h", shape, dtype, offset) for a host array in the int32 buffer or ("d", i) for the i-th
    device array passed beside it (the previous step's results)."""
    treedef: object
    leaves: tuple


def pack_inputs(inp: StepInputs) -> tuple[np.ndarray, list, PackSpec]:
    """(int32 buffer of inp's host arrays (4-byte dtypes), its device arrays, PackSpec)."""
    leaves, treedef = jax.tree_util.tree_flatten(inp)
    parts, device, meta, at = [], [], [], 0
    for x in leaves:
        if isinstance(x, np.ndarray) and x.dtype.itemsize == 4:
            flat = np.ascontiguousarray(x).reshape(-1).view(np.int32)
            meta.append(("h", x.shape, x.dtype.str, at))
            parts.append(flat)
            at += flat.size
        else:
            meta.append(("d", len(device)))
            device.append(x)
    buf = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return buf, device, PackSpec(treedef, tuple(meta))


def unpack_inputs(buf, device: list, spec: PackSpec) -> StepInputs:
    """pack_inputs undone, inside a jit: static slices of buf (no copies once fused)."""
    return jax.tree_util.tree_unflatten(spec.treedef, [device[m[1]] if m[0] == "d" else _host_leaf(buf, m)
                                                       for m in spec.leaves])


def _host_leaf(buf, m):
    """One host array of a packed buffer, by its PackSpec entry ("h", shape, dtype, offset)."""
    _, shape, dtype, at = m
    n = int(np.prod(shape, dtype=np.int64))
    x = buf[at:at + n].reshape(shape)
    return x if np.dtype(dtype) == np.int32 else jax.lax.bitcast_convert_type(x, np.dtype(dtype))


@dataclasses.dataclass
class StepBuffers:
    """The step's persistent device buffers, all passed to every step at the same addresses:
    - kv_out: [(k, v)] a layer of `rows` tokens (the most a step has), donated to every step,
      which writes its new K/V into the first T rows (the commit reads those);
    - held: the packed inputs' buffer by size, refilled in place every step; its last element is
      the step's results slot;
    - results: [2, R, 2], donated: step n writes its (token, logprob) rows into slot n % 2 and
      reads the previous step's (overlapped steps' fed tokens) from the other; the host gets a
      copy of its slot from a small jit of its own (copy_results)."""
    kv_out: list
    results: jax.Array
    held: dict = dataclasses.field(default_factory=dict)
    slot: int = 0

    @classmethod
    def create(cls, cfg: ModelConfig, rows: int, result_rows: int, dtype, sharding) -> "StepBuffers":
        shape = (rows, cfg.num_key_value_heads, cfg.head_dim)
        zeros = jax.jit(lambda: ([(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
                                  for _ in range(cfg.num_hidden_layers)],
                                 jnp.zeros((2, result_rows, 2), jnp.float32)), out_shardings=sharding)
        return cls(*zeros())

    def stage(self, inp: StepInputs) -> tuple[jax.Array, list, PackSpec]:
        """inp packed (with the next results slot), its buffer copied into the persistent one of
        that size: (that buffer, inp's device arrays, PackSpec), the arguments of step_packed."""
        self.slot ^= 1
        buf, device, spec = pack_inputs(inp)
        buf = np.append(buf, np.int32(self.slot))
        held = self.held.get(buf.size)
        if held is None:  # a new size (warm-up meets them all): its refill compiles here, not in serving
            held = jax.device_put(np.zeros_like(buf), self.results.sharding)
        self.held[buf.size] = held = refill(held, buf)
        return held, device, spec


@functools.partial(jax.jit, donate_argnums=0)
def refill(held, fresh):
    """`fresh` copied into the donated `held` (same shape): the output aliases it, so the step
    reads its inputs at the address the step before did."""
    return jax.lax.dynamic_update_slice(held, fresh.astype(held.dtype), (0,))


def step_packed(params, pool, staged: tuple, buffers: StepBuffers, *, cfg: ModelConfig):
    """paged.step on StepBuffers.stage's output: (pool, results, the same as paged.step's);
    buffers' kv_out and results are replaced by the step's (the same buffers, donated and
    returned)."""
    buf, device, spec = staged
    buffers.kv_out, buffers.results = forward_sample_packed(params, pool, buf, device, buffers.kv_out,
                                                            buffers.results, cfg=cfg, spec=spec)
    pool = commit_kv_packed(pool, buffers.kv_out, buf, spec=spec)
    return pool, copy_results(buffers.results, np.int32(buffers.slot), rows=result_rows(spec, buffers.results))


def result_rows(spec: PackSpec, results) -> int:
    """Rows of a step's results: R when the step feeds tokens from the previous one's (overlapped
    steps pad theirs to R), else one a sequence."""
    inp = jax.tree_util.tree_unflatten(spec.treedef, [m[1] for m in spec.leaves])  # shapes, device indices
    return results.shape[1] if inp.prev_results is not None else inp.sample_idx[0]


@functools.partial(jax.jit, static_argnames=("rows",))
def copy_results(results, slot, *, rows: int):
    """The host's copy of one slot's rows (a fresh array outside the step's graph)."""
    return jax.lax.dynamic_index_in_dim(results, slot, keepdims=False)[:rows]


@functools.partial(jax.jit, static_argnames=("cfg", "spec"), donate_argnums=(4, 5))
def forward_sample_packed(params, pool, buf, device, kv_out, results, *, cfg: ModelConfig, spec: PackSpec):
    inp = unpack_inputs(buf, device, spec)
    slot = buf[-1]
    if inp.prev_results is not None:  # the previous step's results: the other slot
        inp = inp.replace(prev_results=results[1 - slot])
    kv_out, rows = _forward_into(params, pool, inp, kv_out, cfg)
    return kv_out, jax.lax.dynamic_update_slice(results, rows[None].astype(results.dtype), (slot, 0, 0))


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnums=0)
def commit_kv_packed(pool, new_kv, buf, *, spec: PackSpec):
    kv_slot = unpack_inputs(buf, [None] * len(spec.leaves), spec).kv_slot
    return [write_kv(pl, k, v, kv_slot) for pl, (k, v) in zip(pool, new_kv)]


def _forward_into(params, pool, inp: StepInputs, kv_out, cfg: ModelConfig):
    """forward_sample with the new K/V written into the first T rows of kv_out (donated by the
    caller's jit, so the step's outputs keep their addresses from step to step)."""
    new_kv, results = _forward_sample(params, pool, inp, cfg)
    kv_out = [(jax.lax.dynamic_update_slice(ko, k.astype(ko.dtype), (0, 0, 0)),
               jax.lax.dynamic_update_slice(vo, v.astype(vo.dtype), (0, 0, 0)))
              for (ko, vo), (k, v) in zip(kv_out, new_kv)]
    return kv_out, results


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

