"""Which LoRA backend a step takes, and how many adapter slots it is padded to.

Under lora_backend "auto" the choice is per step, from measured thresholds kept in one table
(`GPU_THRESHOLDS`; the figures behind them: bench/RESULTS.md, "lora backend"):

- decode, few slots: "xla" (one-hot). Its cost follows slots x max rank (every token meets every
  slot), the kernels' hardly moves with the adapters, so one-hot wins while slots x max_rank stays
  within `onehot_slot_rank` (`hybrid_slots`);
- decode, more slots, within `ranksplit_slots`: "ranksplit" (one launch a module) where jax-triton
  imports;
- decode above, and every prefill step: "pallas" (the segment pair: its empty slots cost nothing,
  and each token meets only its own adapter);
- on a TPU: "pallas_tpu" (the Mosaic pair, pallas_kernels.tpu) for every step;
- elsewhere: "xla" (Pallas runs there only in interpret mode, for tests).

An explicit "xla" / "pallas" / "ranksplit" / "pallas_tpu" forces the backend of every decode step; "ranksplit" is a
decode kernel, so prefill steps under it take "pallas".
"""

from __future__ import annotations

GPU_THRESHOLDS = dict(
    onehot_slot_rank=512,        # one-hot while slots x max_lora_rank <= this ...
    onehot_slots=(8, 32),        # ... within these slot counts (powers of two)
    ranksplit_slots=(16, 64),    # the rank-split kernel's decode slot buckets
)
FORCED = ("xla", "pallas", "ranksplit", "pallas_tpu")


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def hybrid_slots(max_rank: int) -> int:
    """The most slots a GPU decode step keeps on the one-hot path: the largest power of two within
    onehot_slots whose slots x max_rank stays within onehot_slot_rank."""
    lo, hi = GPU_THRESHOLDS["onehot_slots"]
    slots = lo
    while slots < hi and 2 * slots * max_rank <= GPU_THRESHOLDS["onehot_slot_rank"]:
        slots *= 2
    return slots


def ranksplit_unavailable() -> str | None:
    """Why the rank-split kernel cannot run here, or None. The import is lazy: CPU and TPU
    installs never need jax-triton."""
    from triton_kernels.ranksplit import unavailable_reason
    return unavailable_reason()


def select(decode: bool, slots: int, tokens: int, max_rank: int, platform: str,
           ranksplit_ok: bool | None = None) -> str:
    """The "auto" backend of a step of `tokens` rows over `slots` slots (its slot bucket).
    ranksplit_ok: whether the rank-split kernel may run (None: where jax-triton imports)."""
    del tokens  # the thresholds are per slot bucket; a step's rows set its tables' sizes only
    if platform == "tpu":
        return "pallas_tpu"
    if platform != "gpu":
        return "xla"
    if not decode:
        return "pallas"
    if slots <= hybrid_slots(max_rank):
        return "xla"
    lo, hi = GPU_THRESHOLDS["ranksplit_slots"]
    if lo <= slots <= hi:
        if ranksplit_ok is None:
            ranksplit_ok = ranksplit_unavailable() is None
        if ranksplit_ok:
            return "ranksplit"
    return "pallas"


def tpu_unavailable(platform: str) -> str | None:
    """Why the TPU kernels cannot run here, or None: they need a TPU, or TPU interpret mode
    (SLORA_TPU_INTERPRET=1, pallas_kernels.tpu) on any other backend."""
    from pallas_kernels.tpu import INTERPRET_ENV, interpret_mode
    if platform == "tpu" or interpret_mode():
        return None
    return f"needs a TPU (this backend is {platform!r}; {INTERPRET_ENV}=1 runs the kernels in TPU interpret mode)"


def check_backend(option: str, platform: str) -> None:
    """Refuse an option the platform cannot run: "ranksplit" needs a GPU with jax-triton,
    "pallas_tpu" a TPU (or TPU interpret mode)."""
    if option not in ("auto", *FORCED):
        raise ValueError(f"lora_backend must be one of 'auto', {', '.join(map(repr, FORCED))}, got {option!r}")
    if option == "ranksplit":
        reason = "needs a GPU" if platform != "gpu" else ranksplit_unavailable()
        if reason is not None:
            raise ValueError(f"lora_backend='ranksplit' {reason} (the kernel is Triton, through jax-triton); "
                             "use 'auto', 'pallas' or 'xla'")
    if option == "pallas_tpu" and (reason := tpu_unavailable(platform)) is not None:
        raise ValueError(f"lora_backend='pallas_tpu' {reason}; use 'auto', 'pallas' or 'xla'")


def whole_rows_layout(option: str, platform: str) -> bool:
    """Whether adapters are laid out with each rank row on whole pool rows (slora_jax.model.layout):
    when every step runs the TPU kernels, "pallas_tpu" or "auto" on a TPU. The other backends read
    the flat layout; the two differ only for matrices whose features are not whole pool rows."""
    return option == "pallas_tpu" or (option == "auto" and platform == "tpu")


def step_backend(option: str, decode: bool, slots: int, tokens: int, max_rank: int, platform: str,
                 sharded: bool = False) -> str:
    """The backend of one step under lora_backend `option`: select() for "auto", else the forced
    one (prefill steps under "ranksplit" take "pallas"). sharded (tensor parallelism): the
    rank-split kernel is not used (its tables cover a module's whole rows, not a device's share)."""
    if option == "auto":
        name = select(decode, slots, tokens, max_rank, platform, ranksplit_ok=False if sharded else None)
    else:
        name = option
    if name == "ranksplit" and (not decode or sharded):
        return "pallas"
    return name


def slot_bucket(n: int, rows: int, *, decode: bool, option: str, max_rank: int, platform: str,
                prefill_slots: int = 1) -> int:
    """Slots for n distinct adapters in a step of `rows` tokens. The one-hot path costs work per
    slot, so its bucket follows n (powers of two, at least 8, at most the batch); an "auto" decode
    step past hybrid_slots takes the batch's own bucket (the kernels' tables are sized by it); the
    kernels skip empty slots, so prefill under them keeps one bucket of at least prefill_slots."""
    if decode and option == "auto" and platform == "gpu" and n > hybrid_slots(max_rank):
        return _pow2(rows)
    prefill_xla = option == "xla" or (option == "auto" and platform not in ("gpu", "tpu"))
    if decode or prefill_xla:
        return min(_pow2(rows), max(8, _pow2(n)))
    return _pow2(max(n, prefill_slots))
