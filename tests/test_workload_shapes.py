"""Every step shape the GPU benchmark's warm-up compiles for a shipped workload traces on the CPU.

bench/run.py first compiles all of its engine's step buckets (Engine.warmup_shapes) with the
workload's [engine] table and the GPU's backends (one-hot decode LoRA up to hybrid_slots, the
Pallas kernels past it and for prefill, Pallas decode attention). A kernel that refuses one of
those shapes at trace time (a rank tile past the shrink's output, say) costs a GPU call. Here
the tiny model takes each workload's engine table and adapters of its ranks, and every warm-up
shape is traced (not compiled, not run) with the kernels in interpret mode, which checks the
same static bounds.
"""

from __future__ import annotations

import dataclasses

import pytest

from bench.trace import load_workload
from slora_jax import LLM
from slora_jax.engine import step as paged
from slora_jax.model.peft import random_peft_adapter
from slora_jax.model.config import load_model_config


@pytest.mark.parametrize("workload", ["S1", "S2", "S4", "multitenant"])
def test_warmup_shapes_trace_with_gpu_backends(workload, tmp_path):
    w = load_workload(workload)
    cfg = load_model_config("tiny")
    llm = LLM("tiny", dtype="float32", attention_backend="pallas", pool_pages=256, **w.engine_options)
    # the GPU's choices ("auto" selecting for a GPU): one-hot decode LoRA up to hybrid_slots, the
    # Pallas kernels past it (the rank-split kernel is unavailable off a GPU) and for prefill
    llm.engine.opts = dataclasses.replace(llm.engine.opts, lora_backend="auto", platform="gpu")
    for r in sorted(set(w.ranks)):
        llm.load_adapter(f"rank{r}", random_peft_adapter(tmp_path / f"r{r}", cfg, rank=r, seed=r,
                                                         targets=["q_proj", "k_proj", "v_proj", "o_proj"]))
    eng = llm.engine
    shapes = eng.warmup_shapes(max_context=w.longest_context)
    with_lora = [inp for inp in shapes if inp.lora is not None]
    assert with_lora and any(not inp.decode for inp in with_lora), "no LoRA prefill shape to trace"
    assert max(inp.tokens.shape[0] for inp in with_lora if not inp.decode) > 256  # past split-K's limit
    for inp in shapes:
        paged.forward_sample.trace(eng.params, eng.kv, inp, cfg=eng.cfg)
