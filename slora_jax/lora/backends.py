"""The LoRA backends behind one interface: `plan` on the host, `apply` on the device.

`plan(...)` runs with the step's other host inputs: from the step's slots (token_slot, seg_starts,
each module's A/B row indices and ranks) it builds the backend's tables in numpy and returns the
step's `LoraInputs`. `apply(...)` runs inside the jitted step, once per (layer, module): it adds the
module's LoRA delta into the base projection's output y. Three backends:

- XlaBackend ("xla"): one-hot over slots in jnp (slora_jax.lora.xla); no tables. The reference.
- PallasBackend ("pallas"): the segment pair (pallas_kernels.lora): one grouped shrink launch for
  q, k and v, one expand a module; block schedules built on the host. Interpret mode on the CPU.
- RanksplitBackend ("ranksplit"): the Triton rank-split kernel (triton_kernels.ranksplit, through
  jax-triton; GPU only, imported lazily) for every module it takes, one launch a module; the
  others keep the Pallas pair. q, k and v go to the kernel together or not at all (the pair shrinks
  them in one launch).
- TpuBackend ("pallas_tpu"): the Mosaic TPU pair (pallas_kernels.tpu.lora): one shrink and one
  expand a module, work items built inside the jit from seg_starts; no host tables. It reads the
  whole-rows layout (slora_jax.model.layout), which the store takes under this backend. Off a TPU it
  runs only in TPU interpret mode (SLORA_TPU_INTERPRET=1, for tests; pallas_kernels.tpu).
"""

from __future__ import annotations

import abc
import collections

import numpy as np

from pallas_kernels.lora import (ExpandBlockSizes, ShrinkBlockSizes, block_schedule, gemv_shrink, lora_expand,
                                 lora_shrink_group, shrink_schedule)
from pallas_kernels.lora_schedule import BLOCK_T
from pallas_kernels.tpu import interpret_mode
from pallas_kernels.tpu import lora as tpu_lora
from slora_jax.lora.inputs import QKV, LoraInputs, qkv_group, shrink_launches, stack_qkv
from slora_jax.lora.xla import lora_xla_expand, lora_xla_shrink


class LoraBackend(abc.ABC):
    """One LoRA backend: `plan` (host, numpy) and `apply` (device, inside the step)."""
    name = ""

    def plan(self, *, t: int, token_slot, seg_starts, rows: dict, ranks: dict, decode: bool, cfg, max_rank: int,
             dtype, prefill_block_t: int = BLOCK_T) -> LoraInputs:
        """The step's LoraInputs. t: the step's rows; rows / ranks: each module's slot arrays; cfg:
        the ModelConfig (module shapes, pool width kv_size); dtype: the activations' (y's)."""
        return LoraInputs(token_slot=token_slot, seg_starts=seg_starts, rows=rows, ranks=ranks, max_rank=max_rank,
                          backend=self.name)

    @abc.abstractmethod
    def apply(self, lora: LoraInputs, pool_layer, module: str, key, x, y, fin: int, fout: int, *, reduce,
              cache: dict):
        """y + module's delta of x. key: the model's x, by which q, k and v share one shrink
        (cache holds it for the step's layer); reduce: sums xa across tensor-parallel devices."""


class XlaBackend(LoraBackend):
    name = "xla"

    def apply(self, lora, pool_layer, module, key, x, y, fin, fout, *, reduce, cache):
        a_rows, b_rows = lora.rows[module]
        xa = reduce(lora_xla_shrink(x, pool_layer, a_rows, lora.ranks[module], lora.token_slot, lora.max_rank, fin))
        return y + lora_xla_expand(xa.astype(x.dtype), pool_layer, b_rows, lora.max_rank, fout).astype(y.dtype)


class PallasBackend(LoraBackend):
    name = "pallas"

    def __init__(self, shrink_sizes: ShrinkBlockSizes | None = None, expand_sizes: ExpandBlockSizes | None = None):
        self._shrink_sizes, self._expand_sizes = shrink_sizes, expand_sizes

    def sizes(self) -> tuple[ShrinkBlockSizes, ExpandBlockSizes]:
        """The kernels' settings: as given, else this device's tuned ones (looked up once)."""
        if self._shrink_sizes is None:
            self._shrink_sizes = ShrinkBlockSizes.get_default()
        if self._expand_sizes is None:
            self._expand_sizes = ExpandBlockSizes.get_default()
        return self._shrink_sizes, self._expand_sizes

    def plan(self, *, t, token_slot, seg_starts, rows, ranks, decode, cfg, max_rank, dtype,
             prefill_block_t=BLOCK_T, tables: dict | None = None):
        shrink_sizes, expand_sizes = self.sizes()
        block_t = BLOCK_T if decode else prefill_block_t
        tables = dict(tables or {})
        served = {k.split(":", 1)[1] for k in tables if k.startswith("ranksplit:")}
        pair = {m: r for m, r in ranks.items() if m not in served}
        shrink_bt = {}
        if decode:  # MBGMV shrinks where their column tile is wide enough
            for name in shrink_launches(pair):
                fin = cfg.module_shape(QKV[0] if name == "qkv" else name)[0]
                if gemv_shrink(cfg.kv_size, fin, shrink_sizes):
                    shrink_bt[name] = 1
        seen = {}

        def once(kind, rk, build):  # one schedule per distinct set of slots or ranks
            k = (kind, rk.tobytes())
            if k not in seen:
                seen[k] = build()
            return seen[k]
        for module, rk in pair.items():
            mask = (rk > 0).astype(np.int32)
            tables[module] = once("plain", mask, lambda: block_schedule(mask, seg_starts, t, block_t))
        for name, rk in shrink_launches(pair).items():
            bt = shrink_bt.get(name, block_t)
            rk = np.minimum(rk, max_rank).astype(np.int32)
            tables["shrink:" + name] = once(("shrink", bt), rk, lambda: shrink_schedule(
                rk, seg_starts, t, bt, max_rank=max_rank, rank_tile=shrink_sizes.rank_tile))
        rows, stacked = stack_qkv(rows, ranks)
        return LoraInputs(token_slot=token_slot, seg_starts=seg_starts, rows=rows, ranks=ranks, **stacked,
                          max_rank=max_rank, backend=self.name, schedules=tables, block_t=block_t,
                          shrink_block_t=tuple(sorted(shrink_bt.items())), shrink_sizes=shrink_sizes,
                          expand_sizes=expand_sizes)

    def apply(self, lora, pool_layer, module, key, x, y, fin, fout, *, reduce, cache):
        rows = pool_layer.reshape(-1, pool_layer.shape[-1])
        plans = lora.schedules or {}
        group = qkv_group(lora.rows) if module in QKV else (module,)
        group = group if len(group) > 1 else (module,)
        launch = "qkv" if len(group) > 1 else module
        seen = cache.get("shrink")
        if seen is None or seen[0] is not key or seen[1] != group:
            if len(group) > 1 and lora.qkv_a_rows is not None:  # stacked on the host (stack_qkv)
                a_group, r_group = lora.qkv_a_rows, lora.qkv_ranks
            else:
                a_group, r_group = [lora.rows[m][0] for m in group], [lora.ranks[m] for m in group]
            xa = reduce(lora_shrink_group(x, rows, a_group, r_group, lora.seg_starts, max_rank=lora.max_rank,
                                          in_features=fin, schedule=plans.get("shrink:" + launch),
                                          block_t=dict(lora.shrink_block_t).get(launch, lora.block_t),
                                          block_sizes=lora.shrink_sizes))
            seen = cache["shrink"] = (key, group, xa)
        xa = seen[2]
        col = group.index(module) * (xa.shape[-1] // len(group))  # this module's columns of xa
        return lora_expand(y, xa, rows, lora.rows[module][1], lora.ranks[module], lora.seg_starts,
                           max_rank=lora.max_rank, out_features=fout, schedule=plans.get(module), xa_col=col,
                           block_t=lora.block_t, block_sizes=lora.expand_sizes)


class RanksplitBackend(PallasBackend):
    name = "ranksplit"

    def __init__(self, block_sizes=None, **pallas_sizes):
        super().__init__(**pallas_sizes)
        self._ranksplit_sizes = block_sizes

    def ranksplit_sizes(self):
        from triton_kernels.ranksplit import RanksplitBlockSizes
        if self._ranksplit_sizes is None:
            self._ranksplit_sizes = RanksplitBlockSizes.get_default()
        return self._ranksplit_sizes

    def plan(self, *, t, token_slot, seg_starts, rows, ranks, decode, cfg, max_rank, dtype,
             prefill_block_t=BLOCK_T, tables=None):
        sizes = self.ranksplit_sizes()
        split = ranksplit_tables(rows, ranks, seg_starts, t, cfg, max_rank, dtype, sizes) if decode else {}
        served = {k.split(":", 1)[1] for k in split}
        if not served >= {m for m in ranks if m in QKV}:  # the pair's grouped q/k/v shrink keeps them all
            split = {k: v for k, v in split.items() if k.split(":", 1)[1] not in QKV}
        lora = super().plan(t=t, token_slot=token_slot, seg_starts=seg_starts, rows=rows, ranks=ranks,
                            decode=decode, cfg=cfg, max_rank=max_rank, dtype=dtype,
                            prefill_block_t=prefill_block_t, tables=split)
        return lora.replace(ranksplit_sizes=sizes)

    def apply(self, lora, pool_layer, module, key, x, y, fin, fout, *, reduce, cache):
        table = (lora.schedules or {}).get("ranksplit:" + module)
        if table is None:
            return super().apply(lora, pool_layer, module, key, x, y, fin, fout, reduce=reduce, cache=cache)
        from triton_kernels.ranksplit import ranksplit_apply
        rows = pool_layer.reshape(-1, pool_layer.shape[-1])
        return ranksplit_apply(y, x, rows, table, fin=fin, fout=fout, slots=lora.ranks[module].shape[0],
                               block_sizes=lora.ranksplit_sizes)


class TpuBackend(LoraBackend):
    name = "pallas_tpu"
    DECODE_BLOCK_T = 16  # a decode step holds a token or two per adapter: the smallest bf16 block

    def plan(self, *, t, token_slot, seg_starts, rows, ranks, decode, cfg, max_rank, dtype,
             prefill_block_t=BLOCK_T):
        block_t = self.DECODE_BLOCK_T if decode else tpu_lora.LoraBlocks().block_t
        return LoraInputs(token_slot=token_slot, seg_starts=seg_starts, rows=rows, ranks=ranks, max_rank=max_rank,
                          backend=self.name, block_t=block_t)

    def apply(self, lora, pool_layer, module, key, x, y, fin, fout, *, reduce, cache):
        rows = pool_layer.reshape(-1, pool_layer.shape[-1])
        blocks, interpret = tpu_lora.LoraBlocks(block_t=lora.block_t), interpret_mode()
        a_rows, b_rows = lora.rows[module]
        ranks = lora.ranks[module]
        xa = reduce(tpu_lora.lora_shrink(x, rows, a_rows, ranks, lora.seg_starts, max_rank=lora.max_rank,
                                         blocks=blocks, interpret=interpret))
        return tpu_lora.lora_expand(y, xa, rows, b_rows, ranks, lora.seg_starts, max_rank=lora.max_rank,
                                    blocks=blocks, interpret=interpret)


def ranksplit_tables(rows: dict, ranks: dict, seg_starts, t: int, cfg, max_rank: int, dtype, sizes) -> dict:
    """{"ranksplit:" + module: its unit table} for each module the kernel takes (its rows in whole
    chunks of the pool width, y of `dtype`). Tables are cached by their inputs (`_TABLES`)."""
    from triton_kernels import ranksplit
    width, out = cfg.kv_size, {}
    step_key = (t, width, max_rank, sizes, np.asarray(seg_starts).tobytes())
    for m, (a_rows, b_rows) in rows.items():
        fin, fout = cfg.module_shape(m)
        if not ranksplit.applies(width, fin, fout, dtype):
            continue
        key = (step_key, fin, fout, np.asarray(ranks[m]).tobytes(), np.asarray(a_rows).tobytes(),
               np.asarray(b_rows).tobytes())
        table = _TABLES.get(key)
        if table is None:
            table = ranksplit.plan(ranks[m], a_rows, b_rows, seg_starts, t, fin=fin, fout=fout, width=width,
                                   max_rank=max_rank, block_sizes=sizes)
            for arr in table:
                arr.flags.writeable = False  # shared by every step that hits the cache
            _TABLES[key] = table
            if len(_TABLES) > _TABLES_KEPT:
                _TABLES.pop(next(iter(_TABLES)))
        else:
            _TABLES.move_to_end(key)
        out["ranksplit:" + m] = table
    return out


# ranksplit_tables' tables by their inputs, most recent last: a decode batch keeps its slots, rows
# and token counts from step to step until a request joins or ends, so most steps rebuild nothing.
_TABLES: collections.OrderedDict = collections.OrderedDict()
_TABLES_KEPT = 64

BACKENDS: dict[str, LoraBackend] = {"xla": XlaBackend(), "pallas": PallasBackend(), "ranksplit": RanksplitBackend(),
                                   "pallas_tpu": TpuBackend()}


def get_backend(name: str) -> LoraBackend:
    """The backend instance of a name ("xla", "pallas", "ranksplit", "pallas_tpu")."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown LoRA backend {name!r}; one of {sorted(BACKENDS)}") from None


def plan(backend: str, **step) -> LoraInputs:
    """The step's LoraInputs under `backend`: get_backend(backend).plan(**step)."""
    return get_backend(backend).plan(**step)


def pool_lora(lora: LoraInputs, cfg, pool, tp: int = 1):
    """A `model.LoraApply` reading adapters from the pool as it was at the start of the step. The
    backend adds each module's delta into the base output y. tp > 1: one device's share under
    shard_map (slora_jax.model.tp): the device's slice of x shrunk, x·A summed across the axis,
    expanded into the device's slice of y."""
    import jax
    from slora_jax.model import tp as tp_mod
    backend = get_backend(lora.backend)
    caches: dict = {}  # layer -> the backend's per-layer cache (q, k, v share one shrink)
    reduce = tp_mod.psum if tp > 1 else (lambda xa: xa)

    def local(layer, module, key, x, y, fin, fout):
        return backend.apply(lora, pool[layer], module, key, x, y, fin, fout, reduce=reduce,
                             cache=caches.setdefault(layer, {}))

    def apply(layer, module, x, y, _kv):
        if module not in lora.rows:
            return y
        fin, fout = (f // tp for f in cfg.module_shape(module))  # one device's share of A and B
        if tp == 1:
            return local(layer, module, x, x, y, fin, fout)
        d = jax.lax.axis_index(tp_mod.AXIS)
        if module in tp_mod.COLUMN:  # x whole on every device, y this device's columns
            return local(layer, module, x, jax.lax.dynamic_slice_in_dim(x, d * fin, fin, axis=1), y, fin, fout)
        part = local(layer, module, x, x, jax.lax.dynamic_slice_in_dim(y, d * fout, fout, axis=1), fin, fout)
        return jax.lax.dynamic_update_slice_in_dim(y, part, d * fout, axis=1)  # before the base sum
    return apply
