"""Where things sit inside the pool's pages.

Every layer's pool array is `[pages, 2, page_size, W]` with W = num_key_value_heads * head_dim, the
width of one K (or V) vector: a KV token takes one K row and one V row of one page, exactly, so GQA
wastes nothing. Seen as rows, a page holds `2 * page_size` vectors of width W.

An adapter's weights, for one layer, are one flat stream of rows over its pages, the same in every
layer (pages are valid in all layers): for each targeted module in TARGET_MODULES order, A^T
[r, in] then B * scale [r, out], each flattened and padded to whole rows. Ranks are the adapter's
real ranks, so memory is proportional to rank; MLP matrices are simply longer streams.

`whole_rows` (the layout of the TPU LoRA kernels, pallas_kernels/tpu/lora.py): each rank row of a
matrix starts a pool row, `ceil(features / W)` rows of it, zero past `features`. It differs from the
flat stream only where features % W != 0 (llama-7b's MLP: 11008 = 2.69 rows of 4096, laid out as
3, 11.6% more rows on gate, up and down); there the other backends cannot read it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from slora_jax.model.config import TARGET_MODULES, ModelConfig
from slora_jax.model.peft import AdapterError
from slora_jax.model.tp import split_columns


@dataclasses.dataclass(frozen=True)
class ModuleSlot:
    rank: int
    a_row: int  # first row of A^T [rank, in] in the adapter's row stream
    b_row: int  # first row of B [rank, out]
    a_rows: int
    b_rows: int


def matrix_rows(rank: int, features: int, width: int, whole_rows: bool = False) -> int:
    """Pool rows of width `width` that a [rank, features] matrix fills: flattened, or (whole_rows)
    each rank row on whole rows of its own."""
    if whole_rows:
        return rank * -(-features // width)
    return -(-rank * features // width)


@dataclasses.dataclass(frozen=True)
class AdapterLayout:
    modules: dict  # module -> ModuleSlot, for targeted modules only
    rows: int      # rows per layer
    pages: int
    whole_rows: bool = False  # each rank row on whole pool rows (the TPU kernels' layout)

    @staticmethod
    def of(adapter, cfg: ModelConfig, page_size: int, pad_rank: int | None = None,
           whole_rows: bool = False) -> "AdapterLayout":
        """The adapter's layout at its real ranks, or, with pad_rank, the same layout for every
        adapter: rank pad_rank on every module of TARGET_MODULES (a fixed-size slot; the rows past
        the adapter's ranks, and untargeted modules, are zeros)."""
        if pad_rank is not None:
            return AdapterLayout.from_ranks({m: pad_rank for m in TARGET_MODULES}, cfg, page_size, whole_rows)
        ranks: dict[str, int] = {}
        for (_, module), w in adapter.weights.items():
            ranks[module] = max(ranks.get(module, 0), w.rank)  # layers share one layout
        return AdapterLayout.from_ranks(ranks, cfg, page_size, whole_rows)

    @staticmethod
    def from_ranks(ranks: dict[str, int], cfg: ModelConfig, page_size: int,
                   whole_rows: bool = False) -> "AdapterLayout":
        width = cfg.kv_size
        modules, row = {}, 0
        for module in TARGET_MODULES:
            if module not in ranks:
                continue
            fin, fout = cfg.module_shape(module)
            r = ranks[module]
            a_rows, b_rows = (matrix_rows(r, f, width, whole_rows) for f in (fin, fout))
            modules[module] = ModuleSlot(r, row, row + a_rows, a_rows, b_rows)
            row += a_rows + b_rows
        return AdapterLayout(modules, row, -(-row // (2 * page_size)), whole_rows)


def pack_adapter(adapter, layout: AdapterLayout, cfg: ModelConfig, dtype, tp: int = 1) -> np.ndarray:
    """The adapter as rows [L, layout.rows, W] in `dtype`, ready to scatter into its pages. Each
    matrix is written in place, cast once (B scaled in float32 first); the rest stays zero.
    tp > 1: each matrix's rows laid out for a pool split along W over tp devices (A^T on its
    input, B on its output: tp.split_columns)."""
    width = cfg.kv_size
    if tp > 1:
        return _pack_split(adapter, layout, cfg, dtype, tp)
    out = np.zeros((cfg.num_hidden_layers, layout.rows * width), dtype)

    def matrix(layer, first_row, rows, rank, features):  # a view of the matrix's place in `out`
        flat = out[layer, first_row * width:(first_row + rows) * width]
        if layout.whole_rows:
            return flat.reshape(rank, rows // max(rank, 1) * width)[:, :features]
        return flat[:rank * features].reshape(rank, features)

    for (layer, module), w in adapter.weights.items():
        slot = layout.modules[module]
        fin, fout = cfg.module_shape(module)
        a = matrix(layer, slot.a_row, slot.a_rows, slot.rank, fin)
        a[:w.rank] = w.a.T
        b = matrix(layer, slot.b_row, slot.b_rows, slot.rank, fout)
        # B [r, out] is a view of the file's [out, r] (load_peft_adapter): cast in that order,
        # then one float32 transpose (a cast and a transpose in one assignment is slower: it strides).
        with np.errstate(over="ignore", invalid="ignore"):  # _check_finite names what overflows
            b[:w.rank] = np.ascontiguousarray(np.asarray(w.b.T, np.float32).T) * np.float32(w.scale)
        _check_finite(adapter.name, layer, module, a[:w.rank], b[:w.rank], w.scale, dtype)
    return out.reshape(cfg.num_hidden_layers, layout.rows, width)


def _check_finite(name: str, layer: int, module: str, a: np.ndarray, b: np.ndarray, scale: float, dtype) -> None:
    """Refuse an adapter whose A, or B times its scale, does not fit the pool's dtype: one
    non-finite value would put NaN or inf into every row that reads it."""
    for what, m in (("lora_A", a), ("lora_B * scale", b)):
        if not np.isfinite(m).all():
            raise AdapterError(f"adapter {name!r}: layer {layer} {module} {what} (scale {scale:g}) has values "
                               f"that are not finite in {np.dtype(dtype).name}")


def _pack_split(adapter, layout: AdapterLayout, cfg: ModelConfig, dtype, tp: int) -> np.ndarray:
    width = cfg.kv_size
    out = np.zeros((cfg.num_hidden_layers, layout.rows, width), dtype)
    for (layer, module), w in adapter.weights.items():
        slot = layout.modules[module]
        fin, fout = cfg.module_shape(module)
        a = np.zeros((slot.rank, fin), dtype)
        a[:w.rank] = w.a.T
        b = np.zeros((slot.rank, fout), dtype)
        with np.errstate(over="ignore", invalid="ignore"):
            b[:w.rank] = np.asarray(w.b, np.float32) * np.float32(w.scale)  # w.b: [r, out]
        _check_finite(adapter.name, layer, module, a[:w.rank], b[:w.rank], w.scale, dtype)
        out[layer, slot.a_row:slot.a_row + slot.a_rows] = split_columns(a, slot.a_rows, width, tp, layout.whole_rows)
        out[layer, slot.b_row:slot.b_row + slot.b_rows] = split_columns(b, slot.b_rows, width, tp, layout.whole_rows)
    return out


def page_rows(pages: list[int], n_rows: int, page_size: int) -> np.ndarray:
    """Row indices, in a layer's [pages * 2 * page_size, W] row view, of an adapter's first n_rows."""
    per = 2 * page_size
    pages_arr = np.asarray(pages, np.int64)
    rows = (pages_arr[:, None] * per + np.arange(per)[None, :]).reshape(-1)
    return rows[:n_rows].astype(np.int32)
