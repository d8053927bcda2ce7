"""A Mistral-style model with sliding-window attention, against Hugging Face transformers.

The engine attends to the whole context. That equals sliding-window attention while a sequence
fits the window, so LLM keeps sequences within it (ModelConfig.context_limit; unit checks of the
limits in tests/test_weights.py). Here: inside the window the engine's prompt logits are the
oracle's; past it the oracle's differ from full attention's, so the limit is what keeps outputs
right.
"""

from __future__ import annotations

import dataclasses
import subprocess

import numpy as np
import pytest

from conftest import ORACLE_DIR, _oracle_env, oracle_python
from slora_jax import LLM
from slora_jax.model.config import load_model_config

WINDOW = 16


def test_mistral_sliding_window_against_transformers(tmp_path):
    py = oracle_python()
    if py is None:
        pytest.skip("no oracle interpreter (SLORA_SKIP_ORACLE=1)")
    p = subprocess.run([py, str(ORACLE_DIR / "mistral_window.py"), str(tmp_path)], env=_oracle_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    ids, want = np.load(tmp_path / "ids.npy").tolist(), np.load(tmp_path / "logits.npy")
    assert len(ids) > WINDOW
    llm = LLM(tmp_path, dtype="float32", page_size=4, pool_pages=64)
    assert llm.cfg.sliding_window == WINDOW and llm.max_model_len == WINDOW
    got = llm.prompt_logits([ids[:WINDOW]])[0]
    assert np.abs(got - want[:WINDOW]).max() < 1e-4
    # The same weights with the window dropped (full attention over all 24 tokens): equal inside
    # the window, far off past it.
    full = LLM(dataclasses.replace(load_model_config(tmp_path), sliding_window=None), dtype="float32",
               page_size=4, pool_pages=64)
    full.engine.params = llm.engine.params
    got = full.prompt_logits([ids])[0]
    assert np.abs(got[:WINDOW] - want[:WINDOW]).max() < 1e-4
    assert np.abs(got[WINDOW:] - want[WINDOW:]).max() > 0.1
