"""slora_jax.lora's backend selection (select, step_backend, slot_bucket, check_backend) and the
backend interface's host side (plan), table-driven."""

from __future__ import annotations

import numpy as np
import pytest

from slora_jax import lora
from slora_jax.lora import selection

# (decode, slots, max_rank, platform, ranksplit_ok) -> backend
SELECT = [
    (True, 4, 64, "cpu", True, "xla"),             # off the GPU and TPU: one-hot, always
    (False, 64, 64, "cpu", True, "xla"),
    (True, 128, 8, "tpu", True, "pallas_tpu"),     # a TPU: the Mosaic pair, every step
    (False, 8, 64, "gpu", True, "pallas"),          # prefill: the segment pair, any slots
    (False, 256, 64, "gpu", True, "pallas"),
    (True, 8, 64, "gpu", True, "xla"),              # decode, few slots: one-hot (hybrid_slots(64) == 8)
    (True, 16, 64, "gpu", True, "ranksplit"),       # 16..64 slots: rank-split where it runs
    (True, 32, 64, "gpu", True, "ranksplit"),
    (True, 64, 64, "gpu", True, "ranksplit"),
    (True, 32, 64, "gpu", False, "pallas"),         # ... else the pair
    (True, 128, 64, "gpu", True, "pallas"),         # above: the pair
    (True, 32, 16, "gpu", True, "xla"),             # rank 16: one-hot up to 32 slots
    (True, 64, 16, "gpu", True, "ranksplit"),
    (True, 16, 32, "gpu", True, "xla"),             # rank 32: up to 16
]


@pytest.mark.parametrize("decode,slots,max_rank,platform,ok,want", SELECT)
def test_select(decode, slots, max_rank, platform, ok, want):
    assert lora.select(decode, slots, 64, max_rank, platform, ranksplit_ok=ok) == want


def test_select_without_jax_triton_takes_the_pair(monkeypatch):
    """ranksplit_ok None: where jax-triton imports (never on this CPU), else the pair."""
    monkeypatch.setattr(selection, "ranksplit_unavailable", lambda: "needs jax-triton")
    assert lora.select(True, 32, 64, 64, "gpu") == "pallas"
    monkeypatch.setattr(selection, "ranksplit_unavailable", lambda: None)
    assert lora.select(True, 32, 64, 64, "gpu") == "ranksplit"


@pytest.mark.parametrize("max_rank,want", [(4, 32), (8, 32), (16, 32), (32, 16), (64, 8), (128, 8), (256, 8)])
def test_hybrid_slots(max_rank, want):
    """One-hot while slots x max_rank <= 512, a power of two in 8..32."""
    assert lora.hybrid_slots(max_rank) == want


# (option, decode, slots, platform, sharded) -> backend; ranksplit where select would take it
STEP = [
    ("auto", True, 32, "gpu", False, "ranksplit"),
    ("auto", True, 32, "gpu", True, "pallas"),      # tensor parallel: no rank-split tables
    ("auto", False, 32, "gpu", False, "pallas"),
    ("auto", True, 32, "cpu", False, "xla"),
    ("xla", True, 256, "gpu", False, "xla"),         # forced
    ("pallas", True, 4, "gpu", False, "pallas"),
    ("pallas", True, 4, "cpu", False, "pallas"),      # interpret mode on the CPU
    ("ranksplit", True, 4, "gpu", False, "ranksplit"),
    ("ranksplit", False, 4, "gpu", False, "pallas"),  # a decode kernel: prefill takes the pair
]


@pytest.mark.parametrize("option,decode,slots,platform,sharded,want", STEP)
def test_step_backend(option, decode, slots, platform, sharded, want, monkeypatch):
    monkeypatch.setattr(selection, "ranksplit_unavailable", lambda: None)
    assert lora.step_backend(option, decode, slots, 64, 64, platform, sharded=sharded) == want


# (n adapters, rows, decode, option, platform) -> slots
BUCKETS = [
    (3, 64, True, "auto", "gpu", 8),       # one-hot: follows n, at least 8
    (8, 64, True, "auto", "gpu", 8),
    (9, 64, True, "auto", "gpu", 64),      # past hybrid_slots(64): the batch's own bucket
    (9, 40, True, "auto", "gpu", 64),
    (3, 4, True, "auto", "gpu", 4),        # at most the batch
    (20, 64, True, "auto", "cpu", 32),     # CPU: one-hot buckets
    (20, 64, True, "pallas", "gpu", 32),   # forced pair: follows n
    (3, 512, False, "auto", "gpu", 16),    # prefill under the kernels: one bucket of prefill_slots
    (40, 512, False, "auto", "gpu", 64),
    (3, 512, False, "xla", "gpu", 8),      # prefill one-hot: follows n
    (3, 512, False, "auto", "cpu", 8),
]


@pytest.mark.parametrize("n,rows,decode,option,platform,want", BUCKETS)
def test_slot_bucket(n, rows, decode, option, platform, want):
    got = lora.slot_bucket(n, rows, decode=decode, option=option, max_rank=64, platform=platform, prefill_slots=16)
    assert got == want
    assert got >= min(n, rows)


def test_check_backend():
    lora.check_backend("auto", "cpu")
    lora.check_backend("pallas", "cpu")
    with pytest.raises(ValueError, match="ranksplit.*needs a GPU"):
        lora.check_backend("ranksplit", "cpu")
    for gone in ("hybrid", "triton"):
        with pytest.raises(ValueError, match="must be one of"):
            lora.check_backend(gone, "gpu")


def _step(n_slots=4, t=8):
    """A small step's slot arrays for the tiny shape: q, v and o, rank 8, two live slots."""
    from slora_jax.model.config import load_model_config
    cfg = load_model_config("tiny")
    rng = np.random.default_rng(0)
    rows, ranks = {}, {}
    for m in ("q_proj", "v_proj", "o_proj"):
        fin, fout = cfg.module_shape(m)
        ra, rb = (lora.rows_needed(16, f, cfg.kv_size) for f in (fin, fout))
        rows[m] = (rng.integers(1, 50, (n_slots, ra)).astype(np.int32), rng.integers(1, 50, (n_slots, rb)).astype(np.int32))
        ranks[m] = np.array([8, 4] + [0] * (n_slots - 2), np.int32)
    seg = np.array([0, 3, 5] + [5] * (n_slots - 2), np.int32)
    token_slot = np.array([0, 0, 0, 1, 1] + [-1] * (t - 5), np.int32)
    return cfg, dict(t=t, token_slot=token_slot, seg_starts=seg, rows=rows, ranks=ranks, cfg=cfg, max_rank=16,
                     dtype=np.float32)


def test_plan_xla_has_no_tables():
    _, step = _step()
    inputs = lora.plan("xla", decode=True, **step)
    assert inputs.backend == "xla" and inputs.schedules is None and inputs.qkv_a_rows is None


def test_plan_pallas_builds_the_pair_tables():
    """Under "pallas": an expand schedule per module, one shrink launch for q and v together
    (their A rows stacked on the host) and one for o; prefill's block_t is its own."""
    _, step = _step()
    inputs = lora.plan("pallas", decode=True, **step)
    assert inputs.backend == "pallas"
    assert set(inputs.schedules) == {"q_proj", "v_proj", "o_proj", "shrink:qkv", "shrink:o_proj"}
    assert inputs.qkv_a_rows.shape[0] == 2 and inputs.rows["q_proj"][0] is None
    assert inputs.rows["o_proj"][0] is not None
    assert inputs.shrink_sizes == lora.PallasBackend().sizes()[0]
    prefill = lora.plan("pallas", decode=False, prefill_block_t=32, **step)
    assert prefill.block_t == 32 and prefill.shrink_block_t == ()


def test_get_backend_refuses_unknown_names():
    assert isinstance(lora.get_backend("ranksplit"), lora.PallasBackend)  # its fallback for other modules
    with pytest.raises(ValueError, match="unknown LoRA backend"):
        lora.get_backend("hybrid")
