"""A LoRA step's inputs: the batch's adapters as slots, and the host tables its backend planned."""

from __future__ import annotations

import flax.struct
import jax
import numpy as np

from pallas_kernels.lora_schedule import BLOCK_T
from slora_jax.model.config import QKV_MODULES
from slora_jax.model.layout import matrix_rows

QKV = QKV_MODULES  # modules that read the same x: one grouped shrink (Pallas)


@flax.struct.dataclass
class LoraInputs:
    """The batch's distinct adapters (slots), padded to a bucket of Sa slots and rank R.

    rows[module] = (A rows [Sa, RA], B rows [Sa, RB]): row indices into a layer's row view of the
    pool, RA = ceil(R * in / W) (R * ceil(in / W) in the whole-rows layout); ranks[module] [Sa]
    (0: the adapter does not target the module).
    token_slot [T]: the slot of each token's adapter, -1 for base-model tokens; tokens are grouped
    by slot, so seg_starts [Sa+1] gives slot s the tokens [seg_starts[s], seg_starts[s+1]).
    backend: "xla", "pallas" or "ranksplit" (slora_jax.lora.backends).
    schedules: the backend's host tables (its `plan`), or None (xla; or the kernels build their
    schedules in the graph): schedules[module] the expand's block schedule,
    schedules["shrink:" + launch] each shrink launch's ("qkv" for the grouped q/k/v one),
    schedules["ranksplit:" + module] the rank-split kernel's unit table.
    qkv_a_rows [G, Sa, RA], qkv_ranks [G, Sa]: under the kernels, the A rows and ranks of the G >= 2
    of q, k, v the step carries, stacked on the host once a step (`stack_qkv`) for the grouped
    shrink; their rows[m] then hold None for A. None otherwise.
    block_t: tokens per kernel block (the expand's dot M side; the schedules are built with it);
    shrink_block_t: ((launch, block_t), ...) for the shrink launches whose block_t differs (1: MBGMV).
    shrink_sizes / expand_sizes / ranksplit_sizes: the kernels' settings (static; None: defaults).
    """
    token_slot: jax.Array
    seg_starts: jax.Array
    rows: dict
    ranks: dict
    max_rank: int = flax.struct.field(pytree_node=False)
    backend: str = flax.struct.field(pytree_node=False, default="xla")
    schedules: dict | None = None
    qkv_a_rows: jax.Array | None = None
    qkv_ranks: jax.Array | None = None
    block_t: int = flax.struct.field(pytree_node=False, default=BLOCK_T)
    shrink_block_t: tuple = flax.struct.field(pytree_node=False, default=())
    shrink_sizes: object = flax.struct.field(pytree_node=False, default=None)
    expand_sizes: object = flax.struct.field(pytree_node=False, default=None)
    ranksplit_sizes: object = flax.struct.field(pytree_node=False, default=None)


def qkv_group(modules) -> tuple[str, ...]:
    """The modules among q, k and v, in that order, that one grouped shrink takes."""
    return tuple(m for m in QKV if m in modules)


def stack_qkv(rows: dict, ranks: dict) -> tuple[dict, dict]:
    """Host side of the grouped shrink: (rows, LoraInputs fields). With two or more of q, k, v,
    their A rows and ranks stacked ([G, Sa, RA], [G, Sa]) and their rows[m] A entries dropped (the
    kernels read the stack); else rows as given and no fields."""
    group = qkv_group(rows)
    if len(group) < 2:
        return rows, {}
    fields = dict(qkv_a_rows=np.stack([rows[m][0] for m in group]), qkv_ranks=np.stack([ranks[m] for m in group]))
    return {m: ((None, b) if m in group else (a, b)) for m, (a, b) in rows.items()}, fields


def shrink_launches(ranks: dict) -> dict:
    """The shrink launches of a kernel step with each launch's ranks: one per module, q/k/v as one
    ("qkv": each slot's largest rank of the three) where the step carries two or more of them."""
    if sum(m in ranks for m in QKV) > 1:
        out = {m: r for m, r in ranks.items() if m not in QKV}
        out["qkv"] = np.maximum.reduce([ranks[m] for m in QKV if m in ranks])
        return out
    return dict(ranks)


def rows_needed(rank: int, features: int, width: int, whole_rows: bool = False) -> int:
    """Pool rows of width `width` that a [rank, features] matrix fills: flattened, or (whole_rows,
    the TPU kernels' layout) each rank row on whole rows (slora_jax.model.layout.matrix_rows)."""
    return matrix_rows(rank, features, width, whole_rows)
