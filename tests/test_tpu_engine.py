"""The TPU backends ("pallas_tpu") through the engine: selection, the clear error off a TPU, and
the engine's jitted decode and prefill steps cross-lowered for TPU at real model shapes (Mosaic's
tile rules checked without a TPU). Parity with the transformers+peft oracle under these backends
runs in tests/test_parity.py with SLORA_TPU_INTERPRET=1 and SLORA_TEST_LLM_OPTIONS (docs/tpu.md)."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.tpu import INTERPRET_ENV
from slora_jax.engine.step import StepInputs, forward_sample
from slora_jax.lora import LoraInputs
from slora_jax.lora.backends import TpuBackend
from slora_jax.lora.selection import check_backend, select, step_backend
from slora_jax.model.config import load_model_config
from slora_jax.model.weights import _empty_tree, _set, hf_names
from tests.test_tpu_kernels import TPU_KINDS, _on_tpu

S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("slots", [1, 8, 64, 256])
def test_auto_picks_the_tpu_kernels_on_a_tpu(decode, slots):
    assert select(decode, slots, slots, 16, "tpu") == "pallas_tpu"
    assert step_backend("auto", decode, slots, slots, 16, "tpu") == "pallas_tpu"
    assert select(decode, slots, slots, 16, "cpu") == "xla"


def test_tpu_backend_off_a_tpu_needs_interpret(monkeypatch):
    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    for platform in ("cpu", "gpu"):
        with pytest.raises(ValueError, match="pallas_tpu.*needs a TPU"):
            check_backend("pallas_tpu", platform)
    check_backend("pallas_tpu", "tpu")
    monkeypatch.setenv(INTERPRET_ENV, "1")
    check_backend("pallas_tpu", "cpu")


def test_engine_refuses_tpu_attention_off_a_tpu(monkeypatch):
    from slora_jax.config import EngineConfig
    from slora_jax.engine.engine import LoraChoices
    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    with pytest.raises(ValueError, match="attention_backend='pallas_tpu' needs a TPU"):
        LoraChoices.resolve(EngineConfig(attention_backend="pallas_tpu"))


def _abstract_params(cfg, dtype):
    tree = _empty_tree(cfg)
    for path, shape in hf_names(cfg).values():
        _set(tree, path, S(shape, dtype))
    return tree


def _step_inputs(cfg, *, decode: bool, modules, seqs: int, tokens: int, slots: int, max_rank: int, pages: int,
                 page_size: int):
    """Abstract StepInputs of one step as the engine builds them under lora_backend and
    attention_backend "pallas_tpu"."""
    i32, f32, w = jnp.int32, jnp.float32, cfg.kv_size
    rows = {m: (S((slots, -(-max_rank * cfg.module_shape(m)[0] // w)), i32),
                S((slots, -(-max_rank * cfg.module_shape(m)[1] // w)), i32)) for m in modules}
    ranks = {m: S((slots,), i32) for m in modules}
    plan = TpuBackend().plan(t=tokens, token_slot=S((tokens,), i32), seg_starts=S((slots + 1,), i32), rows=rows,
                             ranks=ranks, decode=decode, cfg=cfg, max_rank=max_rank, dtype=jnp.bfloat16)
    assert isinstance(plan, LoraInputs) and plan.backend == "pallas_tpu"
    return StepInputs(tokens=S((tokens,), i32), positions=S((tokens,), i32), kv_slot=S((tokens,), i32),
                      token_seq=S((tokens,), i32), page_table=S((seqs, pages), i32), ctx_lens=S((seqs,), i32),
                      sample_idx=S((seqs,), i32), temperature=S((seqs,), f32), top_k=S((seqs,), i32),
                      top_p=S((seqs,), f32), seeds=S((seqs,), jnp.uint32), steps=S((seqs,), i32), lora=plan,
                      decode=decode, attention_backend="pallas_tpu")


@pytest.mark.parametrize("kind", TPU_KINDS)
@pytest.mark.parametrize("model", ["llama-7b", "llama-3-8b"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_engine_step_lowers_for_tpu(kind, model, decode, monkeypatch):
    """The engine's forward_sample jit (every layer's LoRA and attention, the sampler) lowered for
    TPU with abstract bf16 weights: no Mosaic tile error, one custom call per kernel, in seconds."""
    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    cfg = load_model_config(model)
    w = cfg.kv_size
    modules = [m for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
               if not any(f % w for f in cfg.module_shape(m))]  # llama-7b's MLP is not whole pool rows
    seqs, tokens = (64, 64) if decode else (8, 512)
    inp = _step_inputs(cfg, decode=decode, modules=modules, seqs=seqs, tokens=tokens, slots=64 if decode else 8,
                       max_rank=64, pages=128, page_size=16)
    pool = [S((4096, 2, 16, w), jnp.bfloat16)] * cfg.num_hidden_layers
    start = time.perf_counter()
    with _on_tpu(kind):
        text = forward_sample.trace(_abstract_params(cfg, jnp.bfloat16), pool, inp, cfg=cfg).lower(
            lowering_platforms=("tpu",)).as_text()
    seconds = time.perf_counter() - start
    kernels = ["_shrink_kernel", "_expand_kernel", "_decode_kernel" if decode else "_prefill_kernel"]
    assert text.count("tpu_custom_call") >= len(kernels)  # one per distinct kernel and shape
    for name in kernels:
        assert name in text, name
    assert seconds < 60, f"lowering took {seconds:.1f} s"
    if model == "llama-3-8b":
        assert len(modules) == 7
