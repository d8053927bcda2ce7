"""Tensor parallelism (slora_jax.model.tp): the adapter layout on the host, the options, and the engine
split over two host CPU devices against one device and against the oracle.

The engine runs happen in processes of their own (tests/tp_check.py; a nested pytest of
tests/test_parity.py): XLA's CPU device count is fixed when JAX starts, and this process has one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from slora_jax.model import tp
from slora_jax.model.peft import load_peft_adapter, random_peft_adapter
from slora_jax.model.config import load_model_config
from slora_jax.config import EngineConfig
from slora_jax.model.layout import AdapterLayout, pack_adapter

REPO = Path(__file__).resolve().parents[1]
CFG = load_model_config("tiny")

def _two_devices() -> dict:
    """The environment of a run on two devices: the accelerators where this machine has two or
    more, else two host CPU devices (also on a one-GPU machine, whose default backend is the GPU)."""
    if jax.default_backend() != "cpu" and jax.device_count() >= 2:
        return {}
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    return {"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}


TWO_DEVICES = _two_devices()


def test_split_columns_gives_each_device_its_slice():
    """Device d's columns of the rows, read row-major, start with mat[:, d's slice] row-major; the
    rest is zeros. One device: the matrix flattened into the rows, the single-device layout."""
    mat = np.random.default_rng(0).normal(size=(5, 24)).astype(np.float32)
    rows = -(-5 * 24 // 8)
    out = tp.split_columns(mat, rows, 8, 2)
    assert out.shape == (rows, 8)
    for d in range(2):
        local = out[:, d * 4:(d + 1) * 4].reshape(-1)
        np.testing.assert_array_equal(local[:5 * 12], mat[:, d * 12:(d + 1) * 12].reshape(-1))
        assert not local[5 * 12:].any()
    np.testing.assert_array_equal(tp.split_columns(mat, rows, 8, 1).reshape(-1)[:120], mat.reshape(-1))


def test_pack_adapter_split_holds_the_same_matrices(tmp_path):
    """pack_adapter(tp=2) and pack_adapter(tp=1) hold the same A^T and scaled B of every module
    and layer, each device's slice where tp.split_columns puts it."""
    adapter = load_peft_adapter(random_peft_adapter(tmp_path / "a", CFG, rank=8, seed=3), CFG)
    layout = AdapterLayout.of(adapter, CFG, page_size=16)
    one, two = (pack_adapter(adapter, layout, CFG, np.float32, t) for t in (1, 2))
    width = CFG.kv_size
    for module, slot in layout.modules.items():
        fin, fout = CFG.module_shape(module)
        for row, n, f in ((slot.a_row, slot.a_rows, fin), (slot.b_row, slot.b_rows, fout)):
            for layer in range(CFG.num_hidden_layers):
                mat = one[layer, row:row + n].reshape(-1)[:slot.rank * f].reshape(slot.rank, f)
                assert np.abs(mat).sum() > 0, (module, layer)  # random weights, never all-zero
                np.testing.assert_array_equal(two[layer, row:row + n], tp.split_columns(mat, n, width, 2))


def test_tensor_parallel_options(capsys):
    """Clear errors: a split that does not divide the model, a split size that is not a positive
    integer, and more devices than there are."""
    from slora_jax import LLM
    with pytest.raises(ValueError, match="does not divide tiny's num_attention_heads"):
        tp.TP.make(3, CFG)  # tiny: 4 heads, 2 K/V heads
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(tensor_parallel_size=0)
    if jax.device_count() >= 2:
        pytest.skip("the 'needs 2 devices' errors need a one-device process")
    with pytest.raises(ValueError, match="needs 2 devices"):
        LLM("tiny", dtype="float32", pool_pages=16, tensor_parallel_size=2)  # this process has one device
    server = pytest.importorskip("slora_jax.serve.cli", reason="the server's dependencies (fastapi) are not installed")
    with pytest.raises(SystemExit) as exit_:  # the server's flag reaches the engine: a one-line error, exit 2
        server.main(["--model", "tiny", "--dtype", "float32", "--pool-pages", "16", "--warmup", "off",
                     "--tensor-parallel-size", "2"])
    assert exit_.value.code == 2 and "needs 2 devices" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "tp.json"
    p = subprocess.run([sys.executable, str(REPO / "tests" / "tp_check.py"), str(out), "xla", "pallas"],
                       env={**os.environ, **TWO_DEVICES}, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_tensor_parallel_serves_as_one_device(tp_run, backend):
    """tensor_parallel_size=2 on two CPU devices, async scheduling, after a warm-up that compiled every
    step shape the batch meets: the weights split Megatron style and
    the pool along W; a mixed batch (base rows, adapters of ranks 4-16 on attention only and on
    every module) gives one device's tokens, and logprobs within 1e-5; an adapter registered at
    run time serves and scores (prompt logits) as on one device; no K/V page is left behind."""
    assert tp_run["devices"] == 2
    runs = tp_run["runs"][backend]
    one, two = runs["1"], runs["2"]
    assert two["tokens"] == one["tokens"]
    assert two["warmup_shapes"] > 0 and two["new_shapes_in_serving"] == 0
    assert max(abs(a - b) for x, y in zip(one["logprobs"], two["logprobs"]) for a, b in zip(x, y)) < 1e-5
    s = two["shardings"]
    assert (s["q_proj"], s["o_proj"], s["pool"]) == ("P('tp', None)", "P(None, 'tp')", "P(None, None, None, 'tp')")
    assert s["pool_shard"][-1] * 2 == s["pool_global"][-1] == CFG.kv_size
    assert two["later_tokens"] == runs["one_device_later"]
    for got, want in zip(two["prompt_logits"], runs["one_device_prompt_logits"]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)
    pages = two["pages_after"]
    assert pages["kv_pages"] == 0 and pages["free_pages"] + pages["adapter_pages"] + pages["prefix_cache"]["cached_pages"] == pages["total_pages"]


@pytest.mark.oracle
def test_tensor_parallel_parity_with_the_oracle(oracle):
    """tests/test_parity.py (HF transformers + peft, both fixture models: MHA, and GQA with tied
    embeddings and llama3 rope) again with tensor_parallel_size=2 on two CPU devices, on this session's
    oracle outputs: every configuration but the two tensor parallel does not run."""
    from tests.conftest import _cache_key, oracle_python
    cache = oracle.root.parent.parent / "tp-oracle-cache"
    link = cache / _cache_key(oracle_python())
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(oracle.root.parent, target_is_directory=True)
    env = {**os.environ, **TWO_DEVICES, "SLORA_ORACLE_CACHE": str(cache),
           "SLORA_TEST_LLM_OPTIONS": json.dumps({"tensor_parallel_size": 2})}
    # not: the fused kernel (shrink and expand in one launch leave no place for the sum across the
    # devices: tensor parallel runs them apart), the one-trip pair (its tables are built for one
    # device's rows: tensor parallel keeps lora.py's pair), the rank-split kernel (the same) and
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "-k", "not fused_lora and not onetrip and not ranksplit",
                        str(REPO / "tests" / "test_parity.py")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0 and " passed" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]
    assert " failed" not in p.stdout and " error" not in p.stdout, p.stdout[-4000:]


BIAS_CHECK = """
import dataclasses, json, sys, tempfile
import numpy as np
from slora_jax import LLM
from slora_jax.model.peft import random_peft_adapter
from slora_jax.model.config import TARGET_MODULES, load_model_config
from slora_jax.model.weights import dummy_params, save_hf_weights
cfg = dataclasses.replace(load_model_config("tiny"), bias_modules=TARGET_MODULES, qk_norm=True)
d = tempfile.mkdtemp()
save_hf_weights(dummy_params(cfg, "float32", seed=1), cfg, d)
a = str(random_peft_adapter(d + "/adapter", cfg, rank=8, seed=3))
ids = [1, 5, 7, 9, 11, 13, 2, 4]
out = {}
for q in (None, "int8"):
    for tp in (1, 2):
        llm = LLM(d, adapters={"a": a}, dtype="float32", page_size=4, pool_pages=64, max_lora_rank=8,
                  tensor_parallel_size=tp, quantization=q)
        out[f"{q}-{tp}"] = [x.tolist() for x in llm.prompt_logits([ids, ids], adapter=[None, "a"])]
json.dump(out, open(sys.argv[1], "w"))
"""


def test_tensor_parallel_adds_each_bias_once(tmp_path):
    """A model with a bias on every projection (Llama's attention_bias and mlp_bias) and Qwen3's
    per-head q/k norms, a base row and an adapter row: two devices give one device's logits. The
    o and down biases are added after the sum across the devices (once, not once a device); q, k,
    v, gate and up split with their columns; the norms' weights are whole on each device. The
    same with the projections in int8: a column module's scales split with it, a row module's are
    whole."""
    out = tmp_path / "bias.json"
    p = subprocess.run([sys.executable, "-c", BIAS_CHECK, str(out)], env={**os.environ, **TWO_DEVICES},
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    got = {k: np.asarray(v) for k, v in json.loads(out.read_text()).items()}
    for q in ("None", "int8"):  # and with the projections in int8 (slora_jax.model.quant): scales split alike
        one, two = got[f"{q}-1"], got[f"{q}-2"]
        np.testing.assert_allclose(two, one, atol=1e-4, rtol=0)
        assert np.abs(one[0] - one[1]).max() > 0.1  # the adapter row is not the base row
    assert np.abs(got["int8-1"] - got["None-1"]).max() > 1e-3  # int8 did round the weights
