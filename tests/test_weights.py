"""Weights: HF safetensors round trips, errors, dummy weights, the orbax cache."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.flax import save_file as flax_save_file

from slora_jax.model import weights as W
from slora_jax.model.config import ModelConfig, load_model_config

CFG = ModelConfig(name="t", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
TIED = dataclasses.replace(CFG, tie_word_embeddings=True)


def leaves(params):
    return jax.tree_util.tree_leaves_with_path(params)


def assert_same(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for (path, x), (_, y) in zip(leaves(a), leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


@pytest.fixture(scope="module")
def p32():
    return W.dummy_params(CFG, "float32", seed=0)


# ---- the pytree contract ------------------------------------------------------------------------

def test_pytree_contract(p32):
    q, kv, h, i = CFG.q_size, CFG.kv_size, CFG.hidden_size, CFG.intermediate_size
    assert set(p32) == {"embed_tokens", "layers", "norm", "lm_head"}
    assert isinstance(p32["layers"], list) and len(p32["layers"]) == 2
    want = {"input_layernorm": (h,), "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h),
            "o_proj": (h, q), "post_attention_layernorm": (h,), "gate_proj": (i, h), "up_proj": (i, h),
            "down_proj": (h, i)}
    for layer in p32["layers"]:
        assert {k: v.shape for k, v in layer.items()} == want
    assert p32["embed_tokens"].shape == p32["lm_head"].shape == (128, 64)
    assert all(isinstance(x, jax.Array) for _, x in leaves(p32))
    names = W.hf_names(CFG)
    assert len(names) == 2 * 9 + 3 and names["model.layers.1.self_attn.k_proj.weight"] == (
        ("layers", 1, "k_proj"), (kv, h))
    assert len({path for path, _ in names.values()}) == len(names)  # one-to-one


def test_tied_embeddings_have_no_lm_head(tmp_path):
    p = W.dummy_params(TIED, "float32")
    assert "lm_head" not in p and "lm_head.weight" not in W.hf_names(TIED)
    W.save_hf_weights(p, TIED, tmp_path)
    assert_same(W.load_hf_weights(tmp_path, TIED, "float32"), p)


def test_tied_ignores_checkpoint_lm_head(tmp_path, p32):
    W.save_hf_weights(p32, CFG, tmp_path)  # untied checkpoint, loaded with a tied config
    loaded = W.load_hf_weights(tmp_path, TIED, "float32")
    assert "lm_head" not in loaded
    np.testing.assert_array_equal(loaded["embed_tokens"], p32["embed_tokens"])


# ---- HF round trips -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sharded", [False, True])
def test_hf_round_trip(tmp_path, dtype, sharded):
    params = W.dummy_params(CFG, dtype, seed=3)
    total = sum(x.nbytes for _, x in leaves(params))
    W.save_hf_weights(params, CFG, tmp_path, max_shard_bytes=total // 4 if sharded else None)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    if sharded:
        assert len(files) >= 3 and (tmp_path / W.INDEX_FILE).is_file()
        index = json.loads((tmp_path / W.INDEX_FILE).read_text())
        assert set(index["weight_map"]) == set(W.hf_names(CFG))
        assert index["metadata"]["total_size"] == total
    else:
        assert files == [W.SINGLE_FILE]
    assert_same(W.load_hf_weights(tmp_path, CFG, dtype), params)


def test_config_json_round_trip(tmp_path, p32):
    cfg = dataclasses.replace(CFG, rope_scaling={"rope_type": "llama3", "factor": 8.0}, eos_token_id=[2, 7])
    W.save_hf_weights(p32, cfg, tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    assert d["model_type"] == "llama" and d["architectures"] == ["LlamaForCausalLM"]
    assert d["hidden_act"] == "silu" and d["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0}
    assert d["torch_dtype"] == "float32"
    assert load_model_config(tmp_path) == dataclasses.replace(cfg, name=tmp_path.name)


@pytest.mark.parametrize("extra", [dict(bias_modules=("q_proj", "k_proj", "v_proj")),
                                   dict(bias_modules=("q_proj", "k_proj", "v_proj", "o_proj"), qk_norm=True),
                                   dict(bias_modules=("gate_proj", "up_proj", "down_proj"))],
                         ids=["qwen2", "qwen3-attention-bias", "llama-mlp-bias"])
def test_family_checkpoint_round_trip(tmp_path, extra):
    """Biases and Qwen3's q/k norms: written as Hugging Face names them (config.json's model_type
    and flags, `self_attn.q_proj.bias`, `self_attn.q_norm.weight`), read back to the same config
    and weights; dummy weights draw them nonzero."""
    cfg = dataclasses.replace(CFG, **extra)
    params = W.dummy_params(cfg, "float32", seed=2)
    W.save_hf_weights(params, cfg, tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    arch = "qwen3" if cfg.qk_norm else "qwen2" if len(cfg.bias_modules) == 3 and "q_proj" in cfg.bias_modules \
        else "llama"
    assert d["model_type"] == arch
    assert load_model_config(tmp_path) == dataclasses.replace(cfg, name=tmp_path.name)
    names = W.hf_names(cfg)
    for m in cfg.bias_modules:
        parent = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        path, shape = names[f"model.layers.1.{parent}.{m}.bias"]
        assert shape == (cfg.module_shape(m)[1],) and np.abs(np.asarray(W._get(params, path))).max() > 0
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == cfg.qk_norm
    assert_same(W.load_hf_weights(tmp_path, cfg, "float32"), params)


def test_unsupported_families_are_refused(tmp_path, p32):
    W.save_hf_weights(p32, CFG, tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**d, "model_type": "qwen3_moe"}))
    with pytest.raises(ValueError, match="model_type 'qwen3_moe' is not a Llama-family model"):
        load_model_config(tmp_path)
    with pytest.raises(ValueError, match="no Hugging Face config says that"):
        W.hf_config_dict(dataclasses.replace(CFG, bias_modules=("q_proj", "k_proj", "v_proj"), qk_norm=True))
    with pytest.raises(ValueError, match="names a module that is not a projection"):
        dataclasses.replace(CFG, bias_modules=("lm_head",))


def test_sliding_window_keeps_sequences_within_it(tmp_path, p32):
    """A Mistral-style config.json with sliding_window: full attention equals the window's only
    while a sequence fits it, so max_model_len defaults to the window, a larger one is refused with
    the reason, and a request past it is refused like any over max_model_len. use_sliding_window
    false (a window written down but unused) changes nothing."""
    from slora_jax import LLM, SamplingParams
    W.save_hf_weights(p32, CFG, tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    d.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=16,
             max_position_embeddings=64)
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = load_model_config(tmp_path)
    assert cfg.sliding_window == 16 and cfg.context_limit == 16 and cfg.max_position_embeddings == 64
    assert W.hf_config_dict(cfg)["sliding_window"] == 16  # written back as read
    opts = dict(dtype="float32", page_size=4, pool_pages=64)
    with pytest.raises(ValueError, match="max_model_len=32 exceeds the model's sliding_window=16"):
        LLM(tmp_path, max_model_len=32, **opts)
    assert LLM(tmp_path, max_model_len=8, **opts).max_model_len == 8
    llm = LLM(tmp_path, **opts)
    assert llm.max_model_len == 16
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert len(llm.generate([[5] * 10], sp)[0].token_ids) == 6   # 16 tokens: inside the window
    with pytest.raises(ValueError, match="max_model_len=16"):
        llm.generate([[5] * 11], sp)                                 # 17 tokens: past it
    d["use_sliding_window"] = False
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = load_model_config(tmp_path)
    assert cfg.sliding_window is None and cfg.context_limit == 64


def test_fp32_checkpoint_loaded_as_bf16_equals_cast(tmp_path, p32):
    W.save_hf_weights(p32, CFG, tmp_path)
    loaded = W.load_hf_weights(tmp_path, CFG, jnp.bfloat16)
    assert_same(loaded, jax.tree.map(lambda x: x.astype(jnp.bfloat16), p32))
    # float32 dummy cast to bf16 is the bf16 dummy: drawn in fp32 then cast
    assert_same(loaded, W.dummy_params(CFG, "bfloat16", seed=0))


def test_bf16_files_match_safetensors_library(tmp_path):
    """Our header+memmap reader and writer agree with safetensors' own flax backend on BF16."""
    params = W.dummy_params(CFG, "bfloat16", seed=1)
    W.save_hf_weights(params, CFG, tmp_path / "ours")
    with safe_open(tmp_path / "ours" / W.SINGLE_FILE, framework="flax") as f:
        assert f.metadata() == {"format": "pt"}
        for name, (path, _) in W.hf_names(CFG).items():
            assert f.get_slice(name).get_dtype() == "BF16"
            np.testing.assert_array_equal(f.get_tensor(name), W._get(params, path))
    # a file written by the library (flax backend) reads back through our reader
    lib = tmp_path / "lib"
    lib.mkdir()
    flax_save_file({n: W._get(params, path) for n, (path, _) in W.hf_names(CFG).items()}, lib / W.SINGLE_FILE)
    assert_same(W.load_hf_weights(lib, CFG, "bfloat16"), params)


def test_harmless_extras_ignored(tmp_path, p32):
    tensors = {n: np.asarray(W._get(p32, path)) for n, (path, _) in W.hf_names(CFG).items()}
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    flax_save_file({k: jnp.asarray(v) for k, v in tensors.items()}, tmp_path / W.SINGLE_FILE)
    assert_same(W.load_hf_weights(tmp_path, CFG, "float32"), p32)


# ---- errors -------------------------------------------------------------------------------------

def _write(dir_, tensors):
    dir_.mkdir(exist_ok=True)
    flax_save_file({k: jnp.asarray(v) for k, v in tensors.items()}, dir_ / W.SINGLE_FILE)


def _hf_tensors(params, cfg=CFG):
    return {n: W._get(params, path) for n, (path, _) in W.hf_names(cfg).items()}


def test_missing_tensor(tmp_path, p32):
    t = _hf_tensors(p32)
    del t["model.layers.1.mlp.up_proj.weight"]
    _write(tmp_path, t)
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.mlp\.up_proj\.weight"):
        W.load_hf_weights(tmp_path, CFG, "float32")


def test_missing_shard_file(tmp_path, p32):
    W.save_hf_weights(p32, CFG, tmp_path, max_shard_bytes=100_000)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) >= 3
    shards[1].unlink()
    with pytest.raises(ValueError, match=shards[1].name):
        W.load_hf_weights(tmp_path, CFG, "float32")


def test_wrong_shape(tmp_path, p32):
    t = _hf_tensors(p32)
    t["model.layers.0.self_attn.k_proj.weight"] = jnp.zeros((CFG.q_size, CFG.hidden_size))
    _write(tmp_path, t)
    shapes = r"model\.layers\.0\.self_attn\.k_proj\.weight.*\(64, 64\).*\(32, 64\)"
    with pytest.raises(ValueError, match=shapes):
        W.load_hf_weights(tmp_path, CFG, "float32")


def test_truncated_file(tmp_path, p32):
    W.save_hf_weights(p32, CFG, tmp_path)
    f = tmp_path / W.SINGLE_FILE
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"tensor '.*' is truncated"):
        W.load_hf_weights(tmp_path, CFG, "float32")


def test_unexpected_tensor(tmp_path, p32):
    t = _hf_tensors(p32)
    t["model.layers.0.self_attn.q_proj.bias"] = jnp.zeros(CFG.q_size)
    _write(tmp_path, t)
    with pytest.raises(ValueError, match=r"unexpected.*q_proj\.bias"):
        W.load_hf_weights(tmp_path, CFG, "float32")


def test_bin_checkpoint_needs_conversion(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*converted"):
        W.load_hf_weights(tmp_path, CFG, "float32")
    with pytest.raises(ValueError, match="pytorch_model.bin"):
        W.load_params(tmp_path, CFG, "float32")  # a directory never falls back to dummy weights


def test_bad_dtype():
    with pytest.raises(ValueError, match="int8"):
        W.dummy_params(CFG, "int8")


# ---- dummy weights ------------------------------------------------------------------------------

def test_dummy_deterministic_and_seeded(p32):
    assert_same(W.dummy_params(CFG, "float32", seed=0), p32)
    other = W.dummy_params(CFG, "float32", seed=1)
    for (path, x), (_, y) in zip(leaves(p32), leaves(other)):
        assert not np.array_equal(x, y), path
    for path, x in leaves(p32):
        assert np.any(np.asarray(x) != 0), path
        assert np.all(np.isfinite(x)), path
    # distinct leaves of the same shape are distinct draws
    assert not np.array_equal(p32["layers"][0]["q_proj"], p32["layers"][1]["q_proj"])
    assert not np.array_equal(p32["layers"][0]["gate_proj"], p32["layers"][0]["up_proj"])


def test_dummy_scale(p32):
    q = np.asarray(p32["layers"][0]["down_proj"])
    assert abs(q.std() * np.sqrt(CFG.intermediate_size) - 1) < 0.05  # std 1/sqrt(in_features)
    n = np.asarray(p32["norm"])
    assert abs(n.mean() - 1) < 0.05 and 0 < n.std() < 0.2


# ---- orbax cache --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_orbax_round_trip(tmp_path, dtype):
    params = W.dummy_params(CFG, dtype, seed=2)
    W.save_params(params, tmp_path / "ckpt")
    restored = W.restore_params(tmp_path / "ckpt", CFG, dtype)
    assert_same(restored, params)
    assert isinstance(restored["layers"], list)


def test_load_params_uses_cache(tmp_path, p32, monkeypatch):
    model, cache = tmp_path / "model", tmp_path / "cache"
    W.save_hf_weights(p32, CFG, model)
    calls = []
    real = W.load_hf_weights
    monkeypatch.setattr(W, "load_hf_weights", lambda *a, **k: calls.append(a) or real(*a, **k))

    first = W.load_params(model, CFG, "float32", cache_dir=cache)
    assert len(calls) == 1 and len(list(cache.iterdir())) == 1
    second = W.load_params(model, CFG, "float32", cache_dir=cache)
    assert len(calls) == 1  # restored from the orbax cache, no conversion
    assert_same(first, p32)
    assert_same(second, p32)

    W.load_params(model, CFG, "bfloat16", cache_dir=cache)  # another dtype is another cache entry
    assert len(calls) == 2 and len(list(cache.iterdir())) == 2

    # a rewritten checkpoint is converted again, never served stale from the cache
    new = W.dummy_params(CFG, "float32", seed=9)
    W.save_hf_weights(new, CFG, model)
    st = (model / W.SINGLE_FILE).stat()
    os.utime(model / W.SINGLE_FILE, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # coarse-clock filesystems
    assert_same(W.load_params(model, CFG, "float32", cache_dir=cache), new)
    assert len(calls) == 3


def test_load_params_shape_name_gives_dummy(p32):
    assert_same(W.load_params("no-such-dir-tiny", CFG, "float32", seed=0), p32)
