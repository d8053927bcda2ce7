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

import collections
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import onetrip
from pallas_kernels.lora import BLOCK_T as LORA_BLOCK_T, BLOCKS, fused_applies, lora_expand, lora_fused_delta, lora_shrink_group
from slora_jax.engine.attention import commit_kv, commit_kv_tp, paged_attend, paged_attention_xla  # noqa: F401
from slora_jax.model import llama as model
from slora_jax.model import tp as tp_mod
from slora_jax.model.config import QKV_MODULES, ModelConfig
from slora_jax.sampling import sample
from triton_kernels import ranksplit


@flax.struct.dataclass
class LoraInputs:
    """The batch's distinct adapters (slots), padded to a bucket of Sa slots and rank R.

    rows[module] = (A rows [Sa, RA], B rows [Sa, RB]): row indices into a layer's row view of the
    pool, RA = ceil(R * in / W); ranks[module] [Sa] (0: the adapter does not target the module).
    token_slot [T]: the slot of each token's adapter, -1 for base-model tokens; tokens are grouped
    by slot, so seg_starts [Sa+1] gives slot s the tokens [seg_starts[s], seg_starts[s+1]).
    backend: "xla" (one-hot over slots), "pallas" (pallas_kernels.lora, segment form) or "triton"
    (triton_kernels.lora through jax-triton, the same segment form; GPU only).
    schedules[module] = the kernels' block schedule (pallas_kernels.lora.block_schedule), and
    schedules["shrink:" + module or "shrink:qkv"] each Pallas shrink launch's (shrink_schedule), or
    schedules["fused:" + module] where the fused kernel applies (pallas_kernels.lora.fused_applies),
    built on the host with the step's inputs (Engine._schedules), or None (the kernels build them
    in the graph).
    qkv_a_rows [G, Sa, RA], qkv_ranks [G, Sa]: under "pallas" with group_qkv, the A rows and ranks
    of the G >= 2 of q, k, v the step carries, stacked on the host once a step (`stack_qkv`) for
    the grouped shrink; their rows[m] then hold None for A. None otherwise.
    """
    token_slot: jax.Array
    seg_starts: jax.Array
    rows: dict
    ranks: dict
    max_rank: int = flax.struct.field(pytree_node=False)
    backend: str = flax.struct.field(pytree_node=False, default="xla")
    schedules: dict | None = None
    group_qkv: bool = flax.struct.field(pytree_node=False, default=False)  # see pool_lora
    qkv_a_rows: jax.Array | None = None
    qkv_ranks: jax.Array | None = None
    # Tokens per kernel block (the kernels' dot M side; the schedules are built with it): the
    # decode_block_t of decode steps, EngineOptions.prefill_lora_block_t for prefill steps.
    # shrink_block_t: ((launch, block_t), ...) for the Pallas shrink launches ("qkv" for the
    # grouped q/k/v one, else the module) whose block_t differs (1: MBGMV); the others: block_t.
    block_t: int = flax.struct.field(pytree_node=False, default=LORA_BLOCK_T)
    shrink_block_t: tuple = flax.struct.field(pytree_node=False, default=())


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
    # Packed prefill with context: the rows of page_table and ctx_lens are only the sequences that
    # have context, ctx_seq [C] their sequence rows (-1: padding). None: row i is sequence i.
    ctx_seq: jax.Array | None = None
    # Async scheduling (EngineConfig.async_scheduling): the step is dispatched before the previous
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
# LoRA over the pool (xla): gather each slot's A and B rows, one-hot over slots per token.


def lora_xla(x, pool_layer, a_rows, b_rows, ranks, token_slot, max_rank: int, fin: int, fout: int):
    xa = lora_xla_shrink(x, pool_layer, a_rows, ranks, token_slot, max_rank, fin)
    return lora_xla_expand(xa.astype(x.dtype), pool_layer, b_rows, max_rank, fout)


def _slot_matrices(pool_layer, slot_rows, max_rank: int, features: int):
    """[Sa, R, features]: each slot's matrix (A^T or B) read from its rows of the pool."""
    rows = pool_layer.reshape(-1, pool_layer.shape[-1])
    sa = slot_rows.shape[0]
    return rows[slot_rows].reshape(sa, -1)[:, :max_rank * features].reshape(sa, max_rank, features)


def lora_xla_shrink(x, pool_layer, a_rows, ranks, token_slot, max_rank: int, fin: int):
    """x @ A of every token against every slot, kept only at the token's own slot and the slot's
    rank: [T, Sa, R] float32."""
    a = _slot_matrices(pool_layer, a_rows, max_rank, fin)
    sa = a_rows.shape[0]
    live = (jnp.arange(max_rank)[None, :] < ranks[:, None])  # [Sa, R]
    sel = token_slot[:, None] == jnp.arange(sa)[None, :]      # [T, Sa]
    xa = jnp.einsum("ti,sri->tsr", x, a, preferred_element_type=jnp.float32)
    return jnp.where(sel[:, :, None] & live[None], xa, 0.0)


def lora_xla_expand(xa, pool_layer, b_rows, max_rank: int, fout: int):
    """The delta [T, fout] float32 of lora_xla_shrink's xa (in the activations' dtype)."""
    b = _slot_matrices(pool_layer, b_rows, max_rank, fout)
    return jnp.einsum("tsr,sro->to", xa, b, preferred_element_type=jnp.float32)


QKV = QKV_MODULES  # modules that read the same x: one grouped shrink (Pallas)


def qkv_group(modules) -> tuple[str, ...]:
    """The modules among q, k and v, in that order, that one grouped shrink takes."""
    return tuple(m for m in QKV if m in modules)


def stack_qkv(rows: dict, ranks: dict, backend: str, group_qkv: bool) -> tuple[dict, dict]:
    """Host side of the grouped shrink: (rows, LoraInputs fields). Under "pallas" with group_qkv
    and two or more of q, k, v, their A rows and ranks stacked ([G, Sa, RA], [G, Sa]) and their
    rows[m] A entries dropped (the kernels read the stack); else rows as given and no fields."""
    group = qkv_group(rows)
    if not (group_qkv and backend == "pallas" and len(group) > 1):
        return rows, {}
    fields = dict(qkv_a_rows=np.stack([rows[m][0] for m in group]), qkv_ranks=np.stack([ranks[m] for m in group]))
    return {m: ((None, b) if m in group else (a, b)) for m, (a, b) in rows.items()}, fields


def onetrip_plans(rows: dict, ranks: dict, seg_starts: np.ndarray, t: int, cfg: ModelConfig, group_qkv: bool,
                  max_rank: int) -> dict:
    """Host side of a decode step's one-trip pair (pallas_kernels/onetrip.py, BLOCKS["onetrip"]):
    schedules["onetrip-shrink:" + launch] (q, k, v as launch "qkv" with group_qkv, as pool_lora
    groups them) and schedules["onetrip-expand:" + module], for each shrink launch whose shrink
    and every expand the pair serves (the pool width divides in and each out); pool_lora takes the
    pair where these are present. rows / ranks: the step's per-module arrays (before stack_qkv)."""
    width, out = cfg.kv_size, {}
    group = qkv_group(rows)
    launches = [(m,) for m in rows if not (group_qkv and len(group) > 1 and m in QKV)]
    if group_qkv and len(group) > 1:
        launches.append(group)
    kw = dict(width=width, max_rank=max_rank)
    for mods in launches:
        fin = cfg.module_shape(mods[0])[0]
        if not (onetrip.applies(width, fin) and all(onetrip.applies(width, cfg.module_shape(m)[1]) for m in mods)):
            continue
        expands = {m: onetrip.expand_plan(ranks[m], rows[m][1], seg_starts, t, fout=cfg.module_shape(m)[1], **kw)
                   for m in mods}
        if BLOCKS["onetrip"]["one_launch"]:  # each module's shrink and expand in one launch
            for m in mods:
                out["onetrip-apply:" + m] = (
                    onetrip.shrink_plan(ranks[m][None], rows[m][0][None], seg_starts, t, fin=fin, **kw), expands[m])
            continue
        out["onetrip-shrink:" + ("qkv" if len(mods) > 1 else mods[0])] = onetrip.shrink_plan(
            np.stack([ranks[m] for m in mods]), np.stack([rows[m][0] for m in mods]), seg_starts, t, fin=fin, **kw)
        out.update(("onetrip-expand:" + m, e) for m, e in expands.items())
    return out


def ranksplit_plans(rows: dict, ranks: dict, seg_starts: np.ndarray, t: int, cfg: ModelConfig, max_rank: int,
                    dtype) -> dict:
    """Host side of a decode step's rank-split kernel (triton_kernels/ranksplit.py): schedules["ranksplit:"
    + module], its table, for each module the kernel takes (its rows in whole chunks of the pool width,
    y of `dtype`); pool_lora takes the kernel where these are present. rows / ranks: the step's
    per-module arrays (before stack_qkv)."""
    width, out = cfg.kv_size, {}
    step_key = (t, width, max_rank, tuple(sorted(ranksplit.BLOCKS["ranksplit"].items())),
                np.asarray(seg_starts).tobytes())
    for m, (a_rows, b_rows) in rows.items():
        fin, fout = cfg.module_shape(m)
        if ranksplit.applies(width, fin, fout, dtype):
            key = (step_key, fin, fout, np.asarray(ranks[m]).tobytes(), np.asarray(a_rows).tobytes(),
                   np.asarray(b_rows).tobytes())
            plan = _SPLIT_PLANS.get(key)
            if plan is None:
                plan = ranksplit.plan(ranks[m], a_rows, b_rows, seg_starts, t, fin=fin, fout=fout, width=width,
                                      max_rank=max_rank)
                for arr in plan:
                    arr.flags.writeable = False  # shared by every step that hits the cache
                _SPLIT_PLANS[key] = plan
                if len(_SPLIT_PLANS) > _SPLIT_PLANS_KEPT:
                    _SPLIT_PLANS.pop(next(iter(_SPLIT_PLANS)))
            else:
                _SPLIT_PLANS.move_to_end(key)
            out["ranksplit:" + m] = plan
    return out


# ranksplit_plans' tables by their inputs, most recent last: a decode batch keeps its slots, rows
# and token counts from step to step until a request joins or ends, so most steps rebuild nothing
# (a table is ~0.1-0.3 ms of numpy a module on the host; the key, ~10 µs).
_SPLIT_PLANS: collections.OrderedDict = collections.OrderedDict()
_SPLIT_PLANS_KEPT = 64


def pool_lora(lora: LoraInputs, cfg: ModelConfig, pool, tp: int = 1):
    """A `model.LoraApply` reading adapters from the pool as it was at the start of the step (see
    paged_attention_xla). The kernels add their product into the base output y in place. Under
    "pallas" with group_qkv, the first of q, k and v shrinks all of them in one launch
    (lora_shrink_group; the step's schedules["shrink:qkv"] covers their slots) and each expands from its
    columns of that xa. tp > 1: one device's share under shard_map (slora_jax.model.tp): the device's
    slice of x shrunk, x·A summed across the axis, expanded into the device's slice of y."""
    shrunk: dict = {}  # layer -> (x, modules, xa): the model calls q, k, v with one x
    fused: dict = {}   # layer -> (x, modules, delta): the same for the fused kernel
    reduce = tp_mod.psum if tp > 1 else (lambda xa: xa)

    def y_plus_fused(layer, module, x, y, rows, fin, fout):
        """y + this module's delta from the fused kernel: q, k and v (with group_qkv, when their
        fouts agree) in one launch at the first of them, the others a launch each."""
        qkv = qkv_group(lora.rows)
        grouped = lora.group_qkv and module in QKV and len(qkv) > 1  # the step's schedule is "fused:qkv"
        group = qkv if grouped and len({cfg.module_shape(m)[1] for m in qkv}) == 1 else (module,)  # GQA: apart
        seen = fused.get(layer)
        if seen is None or seen[0] is not x or module not in seen[1]:
            if lora.qkv_a_rows is not None and module in QKV:  # stack_qkv took their A rows
                at = np.array([qkv.index(m) for m in group])
                a, r = (lora.qkv_a_rows, lora.qkv_ranks) if group == qkv else (lora.qkv_a_rows[at], lora.qkv_ranks[at])
            else:
                a, r = jnp.stack([lora.rows[m][0] for m in group]), jnp.stack([lora.ranks[m] for m in group])
            b = jnp.stack([lora.rows[m][1] for m in group])
            seen = fused[layer] = (x, group, lora_fused_delta(
                x, rows, a, b, r, lora.seg_starts, max_rank=lora.max_rank, fin=fin, fout=fout, block_t=lora.block_t,
                schedule=lora.schedules.get("fused:" + ("qkv" if grouped else module)) if lora.schedules else None))
        col = seen[1].index(module) * fout
        return (y.astype(jnp.float32) + seen[2][:y.shape[0], col:col + fout]).astype(y.dtype)

    def apply(layer, module, x, y, _kv):
        if module not in lora.rows:
            return y
        fin, fout = (f // tp for f in cfg.module_shape(module))  # one device's share of A and B
        if tp == 1:
            return apply_local(layer, module, x, x, y, fin, fout)
        d = jax.lax.axis_index(tp_mod.AXIS)
        if module in tp_mod.COLUMN:  # x whole on every device, y this device's columns
            return apply_local(layer, module, x, jax.lax.dynamic_slice_in_dim(x, d * fin, fin, axis=1), y, fin, fout)
        part = apply_local(layer, module, x, x, jax.lax.dynamic_slice_in_dim(y, d * fout, fout, axis=1), fin, fout)
        return jax.lax.dynamic_update_slice_in_dim(y, part, d * fout, axis=1)  # before the base sum

    def apply_local(layer, module, key, x, y, fin, fout):
        """y + the delta of x (this device's slices of both under tp); key: the model's x, by
        which q, k and v share one shrink."""
        a_rows, b_rows = lora.rows[module]
        if lora.backend == "xla":
            xa = reduce(lora_xla_shrink(x, pool[layer], a_rows, lora.ranks[module], lora.token_slot,
                                        lora.max_rank, fin))
            return y + lora_xla_expand(xa.astype(x.dtype), pool[layer], b_rows, lora.max_rank, fout).astype(y.dtype)
        pl = pool[layer]
        rows = pl.reshape(-1, pl.shape[-1])
        plans = lora.schedules or {}
        schedule = plans.get(module)
        if "ranksplit:" + module in plans:  # a decode step's rank-split kernel (ranksplit_plans)
            return ranksplit.ranksplit_apply(y, x, rows, plans["ranksplit:" + module], fin=fin, fout=fout,
                                             slots=lora.ranks[module].shape[0])
        if "onetrip-apply:" + module in plans:  # one launch (onetrip_plans)
            return onetrip.onetrip_apply(y, x, rows, *plans["onetrip-apply:" + module], max_rank=lora.max_rank)
        if lora.backend == "triton":
            from triton_kernels.lora import lora_apply as triton_apply  # needs jax-triton
            return triton_apply(y, x, rows, a_rows, b_rows, lora.ranks[module], lora.seg_starts,
                                max_rank=lora.max_rank, fin=fin, fout=fout, schedule=schedule,
                                block_t=lora.block_t)
        if tp == 1 and fused_applies(x.shape[0]):  # shrink and expand in one launch (BLOCKS["fused"]["decode"])
            return y_plus_fused(layer, module, x, y, rows, fin, fout)
        group = (module,)
        if lora.group_qkv and module in QKV:
            group = qkv_group(lora.rows)
        launch = "qkv" if len(group) > 1 else module
        shrink_bt = dict(lora.shrink_block_t).get(launch, lora.block_t)  # 1: a decode step's (MBGMV)
        one_trip = "onetrip-shrink:" + launch in plans  # a decode step's one-trip pair (onetrip_plans)
        seen = shrunk.get(layer)
        if seen is None or seen[0] is not key or seen[1] != group:
            if one_trip:
                xa = onetrip.onetrip_shrink(x, rows, plans["onetrip-shrink:" + launch], n_modules=len(group),
                                            max_rank=lora.max_rank)
            else:
                group_schedule = plans.get("shrink:" + launch)
                if len(group) > 1 and lora.qkv_a_rows is not None:  # stacked on the host (stack_qkv)
                    a_group, r_group = lora.qkv_a_rows, lora.qkv_ranks
                else:
                    a_group, r_group = [lora.rows[m][0] for m in group], [lora.ranks[m] for m in group]
                xa = reduce(lora_shrink_group(x, rows, a_group, r_group, lora.seg_starts, max_rank=lora.max_rank,
                                              in_features=fin, schedule=group_schedule, block_t=shrink_bt,
                                              token_slot=lora.token_slot))
            seen = shrunk[layer] = (key, group, xa)
        xa = seen[2]
        col = group.index(module) * (xa.shape[-1] // len(group))  # this module's columns of xa
        if one_trip:
            return onetrip.onetrip_expand(y, xa, rows, plans["onetrip-expand:" + module], xa_col=col)
        return lora_expand(y, xa, rows, b_rows, lora.ranks[module], lora.seg_starts, max_rank=lora.max_rank,
                           out_features=fout, schedule=schedule, xa_col=col, block_t=lora.block_t,
                           decode=shrink_bt == 1, token_slot=lora.token_slot)
    return apply


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


def step(params, pool, inp: StepInputs, *, cfg: ModelConfig, tp=None):
    """One engine step: `(pool, results)`; the pool is donated (updated in place). tp (a tp.TP):
    the step split over its mesh (params and pool placed for it)."""
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


def rows_needed(rank: int, features: int, width: int) -> int:
    return -(-rank * features // width)
