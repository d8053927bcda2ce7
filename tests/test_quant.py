"""Weight-only int8 for the base model's projections (slora_jax.model.quant): the rounding bound, the
engine's logits against the same model with the dequantized weights (exact up to float order),
adapters on top, and the bytes saved."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slora_jax import LLM

from slora_jax.model import quant
from slora_jax.model.peft import random_peft_adapter
from slora_jax.model.config import TARGET_MODULES, load_model_config

CFG = load_model_config("tiny")
OPTS = dict(page_size=4, pool_pages=64, max_lora_rank=8)


def test_quantize_weight_rounds_each_row_to_its_scale():
    w = jax.random.normal(jax.random.PRNGKey(7), (24, 40), jnp.float32) * jnp.linspace(0.01, 3.0, 24)[:, None]
    w = w.at[5].set(0.0)  # an all-zero row: a finite scale, zeros out
    q, s = quant.quantize_weight(w)
    assert q.dtype == jnp.int8 and s.shape == (24,) and bool(jnp.all(jnp.isfinite(s)))
    assert int(jnp.abs(q).max()) == 127 and not bool(q[5].any())
    err = jnp.abs(quant.dequantize_weight(q, s, jnp.float32) - w)
    assert bool(jnp.all(err <= s[:, None] / 2 * (1 + 1e-6)))
    amax = np.abs(np.asarray(w)).max(1)
    np.testing.assert_allclose(np.asarray(s), np.where(amax > 0, amax / 127, 1.0), rtol=1e-6)


@pytest.mark.parametrize("lora_backend", ["xla", "pallas"])
def test_int8_engine_equals_the_dequantized_model_with_adapters(tmp_path, lora_backend):
    """A base row and an adapter row in one batch: the int8 engine's prompt logits equal (1e-4) a
    float32 engine's whose projections hold the dequantized weights, and differ from the
    unquantized model's by the rounding only (present, and small against the logits)."""
    a = str(random_peft_adapter(tmp_path / "a", CFG, rank=8, seed=3))
    ids = [1, 5, 7, 9, 11, 13, 2, 4]
    rows = dict(adapter=[None, "a"])
    q = LLM("tiny", adapters={"a": a}, dtype="float32", quantization="int8", lora_backend=lora_backend, **OPTS)
    layer = q.engine.params["layers"][0]
    assert all(layer[m].dtype == jnp.int8 and layer[quant.scale_key(m)].dtype == jnp.float32
               for m in TARGET_MODULES)
    got = q.prompt_logits([ids, ids], **rows)
    full = LLM("tiny", adapters={"a": a}, dtype="float32", lora_backend=lora_backend, **OPTS)
    want_full = full.prompt_logits([ids, ids], **rows)
    for lq, lf in zip(q.engine.params["layers"], full.engine.params["layers"]):
        for m in TARGET_MODULES:
            lf[m] = quant.dequantize_weight(lq[m], lq[quant.scale_key(m)], jnp.float32)
    want = full.prompt_logits([ids, ids], **rows)
    for g, w, f in zip(got, want, want_full):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=0)
        assert 1e-3 < np.abs(g - f).max() < 0.1 * np.abs(f).max()
    assert np.abs(got[1] - got[0]).max() > 0.1  # the adapter acts on the int8 base


def test_int8_halves_the_projections_bytes():
    """bf16 projections -> int8 + a float32 scale a row; the embedding, head and norms unchanged."""
    def proj_bytes(llm):
        return sum(v.nbytes for layer in llm.params["layers"] for k, v in layer.items() if "norm" not in k)
    full = LLM("tiny", dtype="bfloat16", **OPTS)
    q = LLM("tiny", dtype="bfloat16", quantization="int8", **OPTS)
    scales = sum(CFG.module_shape(m)[1] for m in TARGET_MODULES) * 4 * CFG.num_hidden_layers
    assert proj_bytes(q) == proj_bytes(full) // 2 + scales
    assert q.params["embed_tokens"].dtype == jnp.bfloat16


def test_bad_quantization_is_refused_before_loading():
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM("tiny", quantization="int4", **OPTS)
