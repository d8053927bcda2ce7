"""The Llama family's other members: projections with a bias (Qwen2's q, k and v; Llama's
attention_bias and mlp_bias) and Qwen3's per-head q/k norms, served with a LoRA adapter on every
projection, against Hugging Face transformers + peft (tests/oracle/families.py builds them and
their logits)."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from conftest import ORACLE_DIR, _oracle_env, oracle_python
from slora_jax import LLM
from slora_jax.model.config import load_model_config

# what each model has beyond Llama's weights: its biases, or Qwen3's norms
EXTRA = {"qwen2": ("q_proj_bias", "k_proj_bias", "v_proj_bias"),
         "llama_bias": tuple(m + "_bias" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj")),
         "qwen3": ("q_norm", "k_norm")}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    py = oracle_python()
    if py is None:
        pytest.skip("no oracle interpreter (SLORA_SKIP_ORACLE=1)")
    out = tmp_path_factory.mktemp("families")
    p = subprocess.run([py, str(ORACLE_DIR / "families.py"), str(out)], env=_oracle_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    return out


@pytest.mark.parametrize("lora_backend", ["xla", "pallas"])
@pytest.mark.parametrize("name", list(EXTRA))
def test_family_model_with_adapter_against_transformers(built, name, lora_backend):
    """Prompt logits without the adapter and with it, both rows in one mixed batch, within 1e-4 of
    the oracle's; the extra weights matter (zeroing them moves the logits far)."""
    d = built / name
    cfg = load_model_config(d / "model")
    extra = {m + "_bias" for m in cfg.bias_modules} | ({"q_norm", "k_norm"} if cfg.qk_norm else set())
    assert extra == set(EXTRA[name])
    ids = np.load(d / "ids.npy").tolist()
    llm = LLM(d / "model", adapters={"a": str(d / "adapter")}, dtype="float32", page_size=4, pool_pages=64,
              max_lora_rank=8, lora_backend=lora_backend)
    base, lora = llm.prompt_logits([ids, ids], adapter=[None, "a"])
    np.testing.assert_allclose(base, np.load(d / "base.npy"), atol=1e-4, rtol=0)
    np.testing.assert_allclose(lora, np.load(d / "lora.npy"), atol=1e-4, rtol=0)
    for layer in llm.engine.params["layers"]:
        for key in EXTRA[name]:
            layer[key] = 0 * layer[key]
    assert np.abs(llm.prompt_logits([ids])[0] - base).max() > 0.05
