"""Models whose projections add a bias (Qwen2's q, k and v; Llama's attention_bias and mlp_bias),
served with a LoRA adapter on every projection, against Hugging Face transformers + peft
(tests/oracle/bias_models.py builds both and their logits)."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from conftest import ORACLE_DIR, _oracle_env, oracle_python
from slora_jax import LLM
from slora_jax.config import load_model_config

BIASES = {"qwen2": ("q_proj", "k_proj", "v_proj"),
          "llama_bias": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    py = oracle_python()
    if py is None:
        pytest.skip("no oracle interpreter (SLORA_SKIP_ORACLE=1)")
    out = tmp_path_factory.mktemp("bias-models")
    p = subprocess.run([py, str(ORACLE_DIR / "bias_models.py"), str(out)], env=_oracle_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    return out


@pytest.mark.parametrize("lora_backend", ["xla", "pallas"])
@pytest.mark.parametrize("name", list(BIASES))
def test_bias_model_with_adapter_against_transformers(built, name, lora_backend):
    """Prompt logits without the adapter and with it, both rows in one mixed batch, within 1e-4 of
    the oracle's; the biases matter (zeroing them moves the logits far)."""
    d = built / name
    cfg = load_model_config(d / "model")
    assert set(cfg.bias_modules) == set(BIASES[name])
    ids = np.load(d / "ids.npy").tolist()
    llm = LLM(d / "model", adapters={"a": str(d / "adapter")}, dtype="float32", page_size=4, pool_pages=64,
              max_lora_rank=8, lora_backend=lora_backend)
    base, lora = llm.prompt_logits([ids, ids], adapter=[None, "a"])
    np.testing.assert_allclose(base, np.load(d / "base.npy"), atol=1e-4, rtol=0)
    np.testing.assert_allclose(lora, np.load(d / "lora.npy"), atol=1e-4, rtol=0)
    for layer in llm.engine.params["layers"]:
        for m in BIASES[name]:
            layer[m + "_bias"] = 0 * layer[m + "_bias"]
    assert np.abs(llm.prompt_logits([ids])[0] - base).max() > 0.05
