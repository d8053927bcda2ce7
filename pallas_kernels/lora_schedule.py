"""The LoRA kernels' block schedule: every slot's tokens cut into blocks of block_t, back to back.

Built on the host with numpy by the engine once a step (`block_schedule`, `shrink_schedule`, passed to
the kernels as `schedule=`), or in the graph with jnp when a caller passes none. The Pallas shrink
and expand (lora.py) read it inside the kernel: the Triton lowering has no scalar prefetch and no
dynamic grid bounds.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

BLOCK_T = 16  # tokens per block (the dot's M side); the engine may pass more for prefill


def _block_schedule(ranks, seg_starts, t: int, block_t: int, rank_tile: int | None = None,
                    max_rank: int | None = None, xp=jnp):
    """The token blocks of all slots, back to back: sched [3, NB] = (slot, first token, segment end)
    and total [1], the number of live blocks. NB = floor((T + Sa*(block_t-1)) / block_t) bounds
    sum_s ceil(len_s / block_t); blocks past `total` are never visited.

    With rank_tile (the shrink's): the live (block, rank tile) items instead, a slot of rank r
    having ceil(min(r, max_rank) / rank_tile) tiles in each of its blocks: sched [4, NB * tiles],
    row 3 the rank tile. xp = jnp: in the graph (the kernels' fallback when no schedule is given);
    np: on the host (block_schedule, shrink_schedule, which the engine passes)."""
    sa = ranks.shape[0]
    seg_starts = xp.clip(seg_starts, 0, t)
    lens = xp.maximum(seg_starts[1:] - seg_starts[:-1], 0)
    nblk = xp.where(ranks > 0, (lens + block_t - 1) // block_t, 0)
    nb = max(1, (t + sa * (block_t - 1)) // block_t)
    if rank_tile is None:
        items, n = nblk, nb
    else:
        ntile = (xp.minimum(ranks, max_rank) + rank_tile - 1) // rank_tile
        items, n = nblk * ntile, nb * -(-max_rank // rank_tile)
    ends = xp.cumsum(items)
    i = xp.arange(n, dtype=xp.int32)
    if xp is jnp:
        slot = jnp.searchsorted(ends, i, side="right", method="compare_all")  # one fused op on GPU
    else:
        slot = np.searchsorted(ends, i, side="right")
    slot = xp.minimum(slot, sa - 1).astype(xp.int32)
    local = i - (ends[slot] - items[slot])  # this item's place among its slot's
    if rank_tile is None:
        rows = [slot, seg_starts[slot] + local * block_t, seg_starts[slot + 1]]
    else:
        per = xp.maximum(ntile[slot], 1)
        rows = [slot, seg_starts[slot] + (local // per) * block_t, seg_starts[slot + 1], local % per]
    return xp.stack(rows).astype(xp.int32), ends[-1:].astype(xp.int32), n


def block_schedule(ranks, seg_starts, t: int, block_t: int = BLOCK_T, rank_tile: int | None = None,
                   max_rank: int | None = None):
    """`_block_schedule` on the host (numpy): (sched, total [1]) int32, the same arrays. The engine
    builds it once per step and module while it builds the step's other inputs, and passes it as
    `schedule=`: the kernels then launch without the schedule's small XLA ops."""
    sched, total, _ = _block_schedule(np.asarray(ranks, np.int32), np.asarray(seg_starts, np.int32), t, block_t,
                                      rank_tile, max_rank, xp=np)
    return sched, total


def shrink_schedule(ranks, seg_starts, t: int, block_t: int = BLOCK_T, *, max_rank: int, rank_tile: int = 16):
    """The schedule lora_shrink(_group) takes as `schedule=`, on the host: the live (block, rank
    tile) items of the slots' ranks (a group's: the largest rank of each slot over its modules).
    rank_tile: the shrink's (ShrinkBlockSizes.rank_tile)."""
    return block_schedule(ranks, seg_starts, t, block_t, rank_tile, max_rank)


def plan_blocks(ranks, seg_starts, t: int, max_rank: int, block_t: int, max_programs: int,
                 schedule=None, clamp: bool = True, rank_tile: int | None = None):
    """The launch schedule shared by every shrink and expand (Pallas and Triton): ranks clamped to
    max_rank (clamp=False: left to the kernel, which clamps each slot's rank as it reads it: no
    XLA op per call), the schedule and its live total (`schedule`, from block_schedule, or with
    rank_tile from shrink_schedule, if given), the item bound and the program count."""
    ranks = ranks.astype(jnp.int32)
    if clamp:
        ranks = jnp.minimum(ranks, max_rank)
    if schedule is None:
        sched, total, n = _block_schedule(ranks, seg_starts.astype(jnp.int32), t, block_t, rank_tile, max_rank)
    else:
        sched, total = schedule
        n = max(1, (t + ranks.shape[0] * (block_t - 1)) // block_t)
        shape, name = (3, n), "block_schedule"
        if rank_tile is not None:
            n *= -(-max_rank // rank_tile)
            shape, name = (4, n), "shrink_schedule"
        if sched.shape != shape or total.shape != (1,):
            raise ValueError(f"schedule shapes {sched.shape}, {total.shape} are not {name}'s for {t} tokens, "
                             f"{ranks.shape[0]} slots, block_t {block_t}: {shape}, (1,)")
        sched, total = sched.astype(jnp.int32), total.astype(jnp.int32)
    return ranks, sched, total, n, min(n, max_programs)
