"""Parity with the transformers+peft oracle through the engine under both TPU kernels
(lora_backend and attention_backend "pallas_tpu") in TPU interpret mode: a compact subset of
tests/test_parity.py that `make test` runs on two CPU cores (interpret mode simulates every copy
and grid step: a step of the two-layer model takes seconds). Per model (MHA; GQA with tied
embeddings and llama3 rope scaling) the mixed batch (every adapter, base rows, one prompt under
three adapters) generates two greedy tokens: one packed prefill step (the TPU prefill attention
and the LoRA kernels at prefill blocks) and one decode step (decode attention, LoRA at decode
blocks). Tokens are the oracle's, logprobs within 1e-3. The whole suite under these backends:
docs/tpu.md."""

from __future__ import annotations

import numpy as np
import pytest

from pallas_kernels.tpu import INTERPRET_ENV
from pallas_kernels.tpu import lora as tpu_lora
from pallas_kernels.tpu import paged_attention as tpu_attention
from tests.test_parity import LOGPROB_TOL, MIXED, MODELS

pytestmark = pytest.mark.oracle

TPU = dict(lora_backend="pallas_tpu", attention_backend="pallas_tpu", pool_pages=128)
TOKENS = 2
KERNELS = {tpu_lora: ("lora_shrink", "lora_expand"),
           tpu_attention: ("paged_decode_attention", "paged_prefill_attention")}


@pytest.mark.parametrize("model", MODELS)
def test_tpu_kernels_match_the_oracle(oracle, model, monkeypatch):
    from slora_jax import LLM, SamplingParams
    monkeypatch.setenv(INTERPRET_ENV, "1")
    traced: set[str] = set()
    for module, names in KERNELS.items():
        for name in names:
            def spy(*args, _real=getattr(module, name), _name=name, **kwargs):
                traced.add(_name)  # at trace time: the steps really take the kernel
                return _real(*args, **kwargs)
            monkeypatch.setattr(module, name, spy)
    llm = LLM(oracle.model_dir(model), adapters={a: oracle.adapter_dir(model, a) for a in oracle.adapters(model)},
              dtype="float32", **TPU)
    assert (llm.engine.opts.lora_backend, llm.engine.opts.attention_backend) == ("pallas_tpu", "pallas_tpu")
    sp = SamplingParams(max_tokens=TOKENS, temperature=0.0, logprobs=True, ignore_eos=True)
    outs = llm.generate([oracle.prompts[p] for p, _ in MIXED], sp, adapter=[a for _, a in MIXED])
    for out, (p, a) in zip(outs, MIXED):
        tag = f"pallas_tpu: {model}/{a or 'base'} prompt {p}"
        assert list(out.token_ids) == oracle.tokens(model, a, p)[:TOKENS], tag
        err = np.abs(np.asarray(out.logprobs, np.float64) - oracle.logprobs(model, a, p)[:TOKENS]).max()
        assert err < LOGPROB_TOL, f"{tag}: max |logprob - oracle| = {err:.3g}"
    assert traced == {n for names in KERNELS.values() for n in names}, traced
