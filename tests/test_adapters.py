"""PEFT adapter loading: PEFT 0.21 semantics on a tiny GQA Llama shape, and every refusal."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from slora_jax.model.peft import (
    AdapterError,
    LoraAdapter,
    load_peft_adapter,
    peft_tensor_key,
    random_peft_adapter,
    save_peft_adapter,
)
from slora_jax.model.config import TARGET_MODULES, ModelConfig

CFG = ModelConfig(name="t", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2)
# (in, out) written out by hand rather than through CFG.module_shape: k/v are GQA-narrow (2 heads x 16).
SHAPES = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
          "gate_proj": (64, 96), "up_proj": (64, 96), "down_proj": (96, 64)}
LAYERS = range(3)


def keys(layers, modules):
    return {(layer, m) for layer in layers for m in modules}


def check_roundtrip(adapter: LoraAdapter, path, expect: dict[tuple[int, str], tuple[int, float]]):
    """expect: (layer, module) -> (rank, scale). Loaded arrays are the saved tensors transposed."""
    saved = load_file(str(Path(path) / "adapter_model.safetensors"))
    assert set(adapter.weights) == set(expect)
    for (layer, module), (rank, scale) in expect.items():
        w = adapter.weights[(layer, module)]
        in_f, out_f = SHAPES[module]
        assert w.a.shape == (in_f, rank) and w.b.shape == (rank, out_f) and w.rank == rank
        assert w.scale == pytest.approx(scale, rel=1e-12)
        np.testing.assert_array_equal(w.a, saved[peft_tensor_key(layer, module, "A")].T)
        np.testing.assert_array_equal(w.b, saved[peft_tensor_key(layer, module, "B")].T)
        assert w.a.any() and w.b.any()


# ------------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("targets, modules", [
    (["q_proj", "v_proj"], ("q_proj", "v_proj")),
    (["self_attn.k_proj", "mlp.down_proj"], ("k_proj", "down_proj")),  # dotted suffixes
    (["q_proj", "not_in_llama"], ("q_proj",)),  # unmatched names are ignored, as in PEFT
    ("all-linear", TARGET_MODULES),
    ("ALL-LINEAR", TARGET_MODULES),  # PEFT lower-cases the shorthand
    (r".*\.(k_proj|up_proj)", ("k_proj", "up_proj")),  # regex: re.fullmatch on the full name
])
def test_roundtrip_targets(tmp_path, targets, modules):
    random_peft_adapter(tmp_path, CFG, rank=4, targets=targets, alpha=12)
    ad = load_peft_adapter(tmp_path, CFG)
    check_roundtrip(ad, tmp_path, {k: (4, 12 / 4) for k in keys(LAYERS, modules)})


def test_regex_is_fullmatch_on_full_name(tmp_path):
    random_peft_adapter(tmp_path, CFG, rank=2, targets=r"model\.layers\.1\.self_attn\.o_proj")
    check_roundtrip(load_peft_adapter(tmp_path, CFG), tmp_path, {(1, "o_proj"): (2, 2 * 2 / 2)})
    # a bare suffix is not a full match, so as a regex string it selects nothing
    conf = json.loads((tmp_path / "adapter_config.json").read_text())
    conf["target_modules"] = "o_proj"
    (tmp_path / "adapter_config.json").write_text(json.dumps(conf))
    with pytest.raises(AdapterError, match="target_modules='o_proj'.*matches no projection"):
        load_peft_adapter(tmp_path, CFG)


def test_rank_pattern(tmp_path):
    rank_pattern = {"layers.1.mlp.up_proj": 2, "q_proj": 8}
    random_peft_adapter(tmp_path, CFG, rank=4, alpha=16, targets=["q_proj", "v_proj", "up_proj"],
                        rank_pattern=rank_pattern)
    expect = {k: (4, 16 / 4) for k in keys(LAYERS, ("v_proj", "up_proj"))}
    expect |= {k: (8, 16 / 8) for k in keys(LAYERS, ("q_proj",))}
    expect[(1, "up_proj")] = (2, 16 / 2)
    ad = load_peft_adapter(tmp_path, CFG)
    check_roundtrip(ad, tmp_path, expect)
    assert ad.max_rank == 8


def test_rank_pattern_first_matching_key_wins(tmp_path):
    # Both keys match layer 0's q_proj; PEFT's get_pattern_key takes the first in file order. PEFT (and
    # save_peft_adapter) write the config with sort_keys=True, so the full name sorts before "q_proj".
    random_peft_adapter(tmp_path, CFG, rank=4, alpha=8, targets=["q_proj"],
                        rank_pattern={"q_proj": 2, "model.layers.0.self_attn.q_proj": 6})
    expect = {k: (2, 8 / 2) for k in keys(LAYERS, ["q_proj"])} | {(0, "q_proj"): (6, 8 / 6)}
    check_roundtrip(load_peft_adapter(tmp_path, CFG), tmp_path, expect)
    # the same patterns in the other file order give layer 0 rank 2, which the rank-6 tensors contradict
    conf = json.loads((tmp_path / "adapter_config.json").read_text())
    conf["rank_pattern"] = {"q_proj": 2, "model.layers.0.self_attn.q_proj": 6}
    (tmp_path / "adapter_config.json").write_text(json.dumps(conf))
    with pytest.raises(AdapterError, match=r"layers\.0\..*has rank 6.*rank_pattern\['q_proj'\]=2"):
        load_peft_adapter(tmp_path, CFG)


def test_rank_pattern_key_is_anchored_at_a_dot(tmp_path):
    # "proj" must match a whole dotted component: (.*\.)?(proj)$ does not match "...q_proj"
    random_peft_adapter(tmp_path, CFG, rank=4, alpha=8, targets=["q_proj"], rank_pattern={"proj": 2})
    check_roundtrip(load_peft_adapter(tmp_path, CFG), tmp_path, {k: (4, 2.0) for k in keys(LAYERS, ["q_proj"])})


def test_alpha_pattern(tmp_path):
    random_peft_adapter(tmp_path, CFG, rank=4, alpha=8, targets=["k_proj", "v_proj"],
                        alpha_pattern={"v_proj": 32, r"layers\.2\.self_attn\.k_proj": 1})
    expect = {k: (4, 8 / 4) for k in keys(LAYERS, ["k_proj"])}
    expect |= {k: (4, 32 / 4) for k in keys(LAYERS, ["v_proj"])}
    expect[(2, "k_proj")] = (4, 1 / 4)
    check_roundtrip(load_peft_adapter(tmp_path, CFG), tmp_path, expect)


def test_use_rslora(tmp_path):
    random_peft_adapter(tmp_path, CFG, rank=16, alpha=8, targets=["o_proj", "gate_proj"], use_rslora=True,
                        rank_pattern={"gate_proj": 4}, alpha_pattern={"o_proj": 3})
    expect = {k: (16, 3 / math.sqrt(16)) for k in keys(LAYERS, ["o_proj"])}
    expect |= {k: (4, 8 / math.sqrt(4)) for k in keys(LAYERS, ["gate_proj"])}
    check_roundtrip(load_peft_adapter(tmp_path, CFG), tmp_path, expect)


@pytest.mark.parametrize("layers, expect_layers", [([0, 2], [0, 2]), (1, [1]), ([], [0, 1, 2])])
def test_layers_to_transform(tmp_path, layers, expect_layers):
    random_peft_adapter(tmp_path, CFG, rank=4, alpha=4, targets=["q_proj", "down_proj"],
                        layers_to_transform=layers)
    ad = load_peft_adapter(tmp_path, CFG)
    check_roundtrip(ad, tmp_path, {k: (4, 1.0) for k in keys(expect_layers, ["q_proj", "down_proj"])})
    assert ad.layers == tuple(expect_layers)


def write(path, conf: dict, tensors: dict[str, np.ndarray] | None = None):
    """Rewrite an adapter dir's config (and optionally tensors)."""
    (Path(path) / "adapter_config.json").write_text(json.dumps(conf))
    if tensors is not None:
        save_file(tensors, str(Path(path) / "adapter_model.safetensors"))


def base_adapter(path, **kw):
    """A valid adapter; returns (config, tensors) for the test to corrupt."""
    kw.setdefault("rank", 4)
    kw.setdefault("targets", ["q_proj", "v_proj"])
    random_peft_adapter(path, CFG, **kw)
    return (json.loads((Path(path) / "adapter_config.json").read_text()),
            load_file(str(Path(path) / "adapter_model.safetensors")))


def test_layers_pattern(tmp_path):
    conf, _ = base_adapter(tmp_path, layers_to_transform=[1])
    write(tmp_path, conf | {"layers_pattern": "layers"})
    assert set(load_peft_adapter(tmp_path, CFG).weights) == keys([1], ["q_proj", "v_proj"])
    write(tmp_path, conf | {"layers_pattern": ["h", "layers"]})
    assert set(load_peft_adapter(tmp_path, CFG).weights) == keys([1], ["q_proj", "v_proj"])
    write(tmp_path, conf | {"layers_pattern": "lay(ers"})
    with pytest.raises(AdapterError, match="layers_pattern='lay\\(ers' is not a valid regex"):
        load_peft_adapter(tmp_path, CFG)
    write(tmp_path, conf | {"layers_pattern": "h"})  # GPT-2 style name: matches nothing here
    with pytest.raises(AdapterError, match="matches no projection"):
        load_peft_adapter(tmp_path, CFG)


def test_exclude_modules(tmp_path):
    conf, tensors = base_adapter(tmp_path)
    drop = [k for k in tensors if ".layers.0." in k and "v_proj" in k]
    write(tmp_path, conf | {"exclude_modules": ["layers.0.self_attn.v_proj"]},
          {k: v for k, v in tensors.items() if k not in drop})
    assert set(load_peft_adapter(tmp_path, CFG).weights) == keys(LAYERS, ["q_proj", "v_proj"]) - {(0, "v_proj")}
    write(tmp_path, conf | {"exclude_modules": r".*\.0\.self_attn\.v_proj"})  # regex: fullmatch
    assert (0, "v_proj") not in load_peft_adapter(tmp_path, CFG).weights


def test_null_target_modules_means_q_and_v(tmp_path):
    conf, _ = base_adapter(tmp_path, targets=["q_proj", "v_proj"])
    write(tmp_path, conf | {"target_modules": None})
    assert load_peft_adapter(tmp_path, CFG).targets == ("q_proj", "v_proj")


def test_adapter_name_in_keys_and_missing_prefix(tmp_path):
    conf, tensors = base_adapter(tmp_path)
    renamed = {}
    for i, (k, v) in enumerate(tensors.items()):
        k = k.replace(".weight", ".default.weight") if i % 2 else k
        renamed[k.removeprefix("base_model.model.") if i % 3 == 0 else k] = v
    write(tmp_path, conf, renamed)
    ad = load_peft_adapter(tmp_path, CFG)
    assert set(ad.weights) == keys(LAYERS, ["q_proj", "v_proj"])
    np.testing.assert_array_equal(ad.weights[(2, "v_proj")].b, tensors[peft_tensor_key(2, "v_proj", "B")].T)


def test_all_zero_b_is_legal(tmp_path):
    conf, tensors = base_adapter(tmp_path)
    write(tmp_path, conf, {k: (np.zeros_like(v) if "lora_B" in k else v) for k, v in tensors.items()})
    assert not load_peft_adapter(tmp_path, CFG).weights[(0, "q_proj")].b.any()


@pytest.mark.parametrize("saved", [np.float32, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("want", [np.float32, np.float16, ml_dtypes.bfloat16, "bfloat16", "float16", None])
def test_dtype_conversion(tmp_path, saved, want):
    random_peft_adapter(tmp_path, CFG, rank=4, targets=["k_proj"], dtype=saved)
    saved_a = load_file(str(tmp_path / "adapter_model.safetensors"))[peft_tensor_key(1, "k_proj", "A")]
    assert saved_a.dtype == np.dtype(saved)
    w = load_peft_adapter(tmp_path, CFG, dtype=want).weights[(1, "k_proj")]
    want_dtype = (np.dtype(saved) if want is None else
                  np.dtype(ml_dtypes.bfloat16) if want == "bfloat16" else np.dtype(want))
    assert w.a.dtype == want_dtype and w.b.dtype == want_dtype
    np.testing.assert_array_equal(w.a, saved_a.T.astype(want_dtype))
    # Views of the cast file arrays, in the file's order: no transposing copy at load time.
    assert w.a.T.flags.c_contiguous and w.b.T.flags.c_contiguous


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_bfloat16_kept_as_is_is_refused(tmp_path, bad):
    """dtype=None (the adapter store's load) keeps bfloat16 as bfloat16; its finiteness check reads
    the exponent bits instead of a float32 copy, and still names the tensor."""
    conf, tensors = base_adapter(tmp_path)
    key = next(k for k in tensors if "lora_B" in k)
    t = tensors[key].astype(ml_dtypes.bfloat16)
    t.flat[3] = bad
    write(tmp_path, conf, {**{k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}, key: t})
    with pytest.raises(AdapterError, match=re.escape(key)):
        load_peft_adapter(tmp_path, CFG, dtype=None)
    ok = dict(tensors)
    write(tmp_path, conf, {k: v.astype(ml_dtypes.bfloat16) for k, v in ok.items()})
    assert load_peft_adapter(tmp_path, CFG, dtype=None).weights  # the same file, finite: loads


def test_adapter_helpers(tmp_path):
    random_peft_adapter(tmp_path / "my-lora", CFG, rank=4, targets=["down_proj", "q_proj"],
                        rank_pattern={"q_proj": 8})
    ad = load_peft_adapter(tmp_path / "my-lora", CFG, max_rank=8)
    assert ad.name == "my-lora" and ad.path == str(tmp_path / "my-lora")
    assert load_peft_adapter(tmp_path / "my-lora", CFG, name="x").name == "x"
    assert ad.targets == ("q_proj", "down_proj")  # engine (TARGET_MODULES) order
    assert ad.layers == (0, 1, 2) and ad.max_rank == 8
    per_layer = 8 * (64 + 64) + 4 * (96 + 64)
    assert ad.num_params == 3 * per_layer and ad.nbytes == 4 * ad.num_params
    assert list(ad.weights) == [(0, "q_proj"), (0, "down_proj"), (1, "q_proj"), (1, "down_proj"),
                                (2, "q_proj"), (2, "down_proj")]


def test_save_peft_adapter_layout(tmp_path):
    t = {peft_tensor_key(0, "q_proj", "A"): np.ones((2, 64), np.float32)}
    save_peft_adapter(tmp_path / "a", {"peft_type": "LORA", "r": 2}, t)
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text()) == {"peft_type": "LORA", "r": 2}
    from safetensors import safe_open
    with safe_open(str(tmp_path / "a" / "adapter_model.safetensors"), "np") as f:
        assert f.metadata() == {"format": "pt"} and list(f.keys()) == list(t)


# ------------------------------------------------------------------------------------------------
# refusals: each names its field / tensor / file


@pytest.mark.parametrize("field, value, match", [
    ("use_dora", True, "use_dora"),
    ("fan_in_fan_out", True, "fan_in_fan_out"),
    ("modules_to_save", ["lm_head"], "modules_to_save"),
    ("bias", "all", "bias='all'"),
    ("bias", "lora_only", "bias='lora_only'"),
    ("lora_bias", True, "lora_bias"),
    ("peft_type", "IA3", "peft_type='IA3'"),
    ("peft_type", None, "peft_type=None"),
    ("use_qalora", True, "use_qalora"),
    ("layer_replication", [[0, 2], [1, 3]], "layer_replication"),
    ("trainable_token_indices", [1, 2], "trainable_token_indices"),
    ("target_parameters", ["mlp.experts.down_proj"], "target_parameters"),
    ("alora_invocation_tokens", [5, 6], "alora_invocation_tokens"),
    ("init_lora_weights", "pissa_niter_4", "init_lora_weights='pissa_niter_4'"),
    ("init_lora_weights", "olora", "init_lora_weights='olora'"),
    ("init_lora_weights", "loftq", "init_lora_weights='loftq'"),
    ("r", 0, "r=0"),
    ("r", 4.0, "r=4.0"),
    ("lora_alpha", "8", "lora_alpha='8'"),
    ("rank_pattern", {"q_proj": 0}, r"rank_pattern\['q_proj'\]=0"),
    ("rank_pattern", {"q_(": 2}, r"rank_pattern\['q_\('\].*regex"),
    ("alpha_pattern", [1], "alpha_pattern"),
    ("target_modules", "q_proj(", "target_modules.*regex"),
    ("target_modules", ["q_proj", "embed_tokens"], "target_modules.*'model.embed_tokens'.*not supported"),
    ("target_modules", ["lm_head", "q_proj"], "target_modules.*'lm_head'.*not supported"),
    ("target_modules", r".*(q_proj|lm_head)", "target_modules.*'lm_head'"),
    ("target_modules", ["q_proj", "mlp"], "target_modules.*'model.layers.0.mlp'.*not a linear projection"),
    ("target_modules", ["input_layernorm"], "target_modules.*input_layernorm.*not a linear projection"),
    ("target_modules", ["c_attn"], "target_modules=\\['c_attn'\\].*matches no projection"),
    ("target_modules", 3, "target_modules=3"),
    ("layers_to_transform", [7], "layers_to_transform=\\[7\\].*matches no projection"),
    ("layers_to_transform", "0", "layers_to_transform='0'"),
    ("layers_pattern", "layers", "layers_pattern='layers' needs layers_to_transform"),
    ("exclude_modules", "q_(", "exclude_modules.*regex"),
    ("exclude_modules", 5, "exclude_modules=5"),
])
def test_config_refusals(tmp_path, field, value, match):
    conf, _ = base_adapter(tmp_path)
    write(tmp_path, conf | {field: value})
    with pytest.raises(AdapterError, match=match):
        load_peft_adapter(tmp_path, CFG)


@pytest.mark.parametrize("targets", ["all-linear", r".*q_proj"])
@pytest.mark.parametrize("field, value", [("layers_to_transform", [0]), ("layers_pattern", "layers")])
def test_layer_selection_needs_list_targets(tmp_path, targets, field, value):
    conf, _ = base_adapter(tmp_path, targets=targets)
    write(tmp_path, conf | {field: value})
    with pytest.raises(AdapterError, match=f"{field}=.*cannot be used when target_modules is a string"):
        load_peft_adapter(tmp_path, CFG)


def test_missing_directory(tmp_path):
    with pytest.raises(AdapterError, match="adapter directory not found"):
        load_peft_adapter(tmp_path / "nope", CFG)


def test_missing_config(tmp_path):
    base_adapter(tmp_path)
    (tmp_path / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        load_peft_adapter(tmp_path, CFG)


def test_bad_json_config(tmp_path):
    base_adapter(tmp_path)
    (tmp_path / "adapter_config.json").write_text("{r: 4")
    with pytest.raises(AdapterError, match="adapter_config.json: not valid JSON"):
        load_peft_adapter(tmp_path, CFG)


def test_missing_weights(tmp_path):
    base_adapter(tmp_path)
    (tmp_path / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="no adapter_model.safetensors"):
        load_peft_adapter(tmp_path, CFG)


def test_bin_weights_only(tmp_path):
    base_adapter(tmp_path)
    (tmp_path / "adapter_model.safetensors").rename(tmp_path / "adapter_model.bin")
    with pytest.raises(AdapterError, match="only adapter_model.bin.*convert it to adapter_model.safetensors"):
        load_peft_adapter(tmp_path, CFG)


def test_corrupt_safetensors(tmp_path):
    base_adapter(tmp_path)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x07" * 20)
    with pytest.raises(AdapterError, match="adapter_model.safetensors: cannot read safetensors"):
        load_peft_adapter(tmp_path, CFG)


def refuse_tensors(path, edit, match, conf_edit=None, **kw):
    """Apply `edit` to a valid adapter's tensors dict and expect an AdapterError matching `match`."""
    conf, tensors = base_adapter(path)
    edit(tensors)
    write(path, conf | (conf_edit or {}), tensors)
    with pytest.raises(AdapterError, match=match):
        load_peft_adapter(path, CFG, **kw)


def test_dora_magnitude_tensor(tmp_path):
    def edit(t):
        t["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"] = np.ones(64, np.float32)
    refuse_tensors(tmp_path, edit, r"layers\.0\.self_attn\.q_proj\.lora_magnitude_vector.*use_dora")


def test_lm_head_tensors(tmp_path):
    def edit(t):
        t["base_model.model.lm_head.lora_A.weight"] = np.ones((4, 64), np.float32)
        t["base_model.model.lm_head.lora_B.weight"] = np.ones((128, 4), np.float32)
    refuse_tensors(tmp_path, edit, r"'base_model\.model\.lm_head\.lora_A\.weight'.*lm_head")


def test_embed_tokens_tensors(tmp_path):
    def edit(t):
        t["base_model.model.model.embed_tokens.lora_embedding_A"] = np.ones((4, 128), np.float32)
    refuse_tensors(tmp_path, edit, r"embed_tokens\.lora_embedding_A.*embed_tokens")


def test_lora_bias_tensor(tmp_path):
    def edit(t):
        t["base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias"] = np.ones(64, np.float32)
    refuse_tensors(tmp_path, edit, r"q_proj\.lora_B\.bias.*lora_bias")


@pytest.mark.parametrize("key", [
    "base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight",   # fused, not Llama
    "base_model.model.model.layers.0.mlp.q_proj.lora_A.weight",           # wrong parent
    "base_model.model.model.layers.0.self_attn.rotary_emb.lora_A.weight",
    "base_model.model.model.norm.weight",
])
def test_unknown_module_tensor(tmp_path, key):
    def edit(t):
        t[key] = np.ones((4, 64), np.float32)
    refuse_tensors(tmp_path, edit, f"tensor '{key}' is not a lora_A/lora_B weight")


def test_layer_beyond_model(tmp_path):
    def edit(t):
        t[peft_tensor_key(3, "q_proj", "A")] = t[peft_tensor_key(0, "q_proj", "A")]
        t[peft_tensor_key(3, "q_proj", "B")] = t[peft_tensor_key(0, "q_proj", "B")]
    refuse_tensors(tmp_path, edit, r"layers\.3\.self_attn\.q_proj\.lora_A\.weight.*num_hidden_layers=3")


def test_tensor_for_untargeted_module(tmp_path):
    def edit(t):
        t[peft_tensor_key(0, "k_proj", "A")] = np.ones((4, 64), np.float32)
        t[peft_tensor_key(0, "k_proj", "B")] = np.ones((32, 4), np.float32)
    refuse_tensors(tmp_path, edit, r"layers\.0\.self_attn\.k_proj.*target_modules=.*does not select")


def test_targeted_module_without_tensors(tmp_path):
    def edit(t):
        del t[peft_tensor_key(1, "v_proj", "A")], t[peft_tensor_key(1, "v_proj", "B")]
    refuse_tensors(tmp_path, edit, r"target_modules selects model\.layers\.1\.self_attn\.v_proj.*no lora_A")


@pytest.mark.parametrize("missing, present", [("A", "B"), ("B", "A")])
def test_missing_half_of_pair(tmp_path, missing, present):
    def edit(t):
        del t[peft_tensor_key(2, "q_proj", missing)]
    refuse_tensors(tmp_path, edit, rf"q_proj\.lora_{present}\.weight' has no matching lora_{missing}")


def test_duplicate_tensor(tmp_path):
    def edit(t):
        named = peft_tensor_key(0, "q_proj", "A").replace(".weight", ".default.weight")
        t[named] = t[peft_tensor_key(0, "q_proj", "A")]
    refuse_tensors(tmp_path, edit, "duplicate lora_A tensors for layer 0 q_proj")


@pytest.mark.parametrize("ab, shape, match", [
    ("A", (4, 32), r"q_proj\.lora_A\.weight' has shape \[4, 32\], expected \[r, 64\] for q_proj"),
    ("A", (64, 4), r"q_proj\.lora_A\.weight' has shape \[64, 4\], expected \[r, 64\]"),  # saved as [in, r]
    ("B", (4, 32), r"q_proj\.lora_B\.weight' has shape \[4, 32\], expected \[64, r\]"),  # saved as [r, out]
    ("B", (64, 4), r"v_proj\.lora_B\.weight' has shape \[64, 4\], expected \[32, r\] for v_proj"),  # GQA
    ("B", (32,), r"v_proj\.lora_B\.weight' has shape \[32\], expected \[32, r\]"),
])
def test_shape_mismatch(tmp_path, ab, shape, match):
    module = "v_proj" if match.startswith("v_proj") else "q_proj"

    def edit(t):
        t[peft_tensor_key(1, module, ab)] = np.ones(shape, np.float32)
    refuse_tensors(tmp_path, edit, match)


def test_rank_disagrees_with_r(tmp_path):
    def edit(t):
        t[peft_tensor_key(0, "q_proj", "A")] = np.ones((2, 64), np.float32)
        t[peft_tensor_key(0, "q_proj", "B")] = np.ones((64, 2), np.float32)
    refuse_tensors(tmp_path, edit, r"q_proj\.lora_A\.weight' has rank 2, but adapter_config.json gives r=4")


def test_rank_disagrees_with_rank_pattern(tmp_path):
    refuse_tensors(tmp_path, lambda t: None,
                   r"has rank 4, but adapter_config.json gives rank_pattern\['v_proj'\]=8",
                   conf_edit={"rank_pattern": {"v_proj": 8}})


def test_a_and_b_ranks_disagree(tmp_path):
    def edit(t):
        t[peft_tensor_key(0, "v_proj", "B")] = np.ones((32, 3), np.float32)
    refuse_tensors(tmp_path, edit, r"v_proj\.lora_B\.weight' has rank 3, but adapter_config.json gives r=4")


def test_max_rank_from_r(tmp_path):
    base_adapter(tmp_path, rank=8)
    assert load_peft_adapter(tmp_path, CFG, max_rank=8).max_rank == 8
    with pytest.raises(AdapterError, match=r"r=8 for model\.layers\.0\.self_attn\.q_proj exceeds max_rank=4"):
        load_peft_adapter(tmp_path, CFG, max_rank=4)


def test_max_rank_from_rank_pattern(tmp_path):
    base_adapter(tmp_path, rank=4, rank_pattern={"v_proj": 16})
    with pytest.raises(AdapterError, match=r"rank_pattern\['v_proj'\]=16 .*exceeds max_rank=8"):
        load_peft_adapter(tmp_path, CFG, max_rank=8)


def test_non_finite_weights(tmp_path):
    def edit(t):
        t[peft_tensor_key(2, "v_proj", "B")][3, 1] = np.nan
    refuse_tensors(tmp_path, edit, r"v_proj\.lora_B\.weight' has non-finite values")


def test_overflow_in_conversion(tmp_path):
    def edit(t):
        t[peft_tensor_key(0, "q_proj", "A")][0, 0] = 1e6  # fine in float32, inf in float16
    refuse_tensors(tmp_path, edit, r"q_proj\.lora_A\.weight' has non-finite values as float16",
                   dtype=np.float16)


def test_integer_tensor(tmp_path):
    def edit(t):
        t[peft_tensor_key(0, "q_proj", "A")] = np.ones((4, 64), np.int32)
    refuse_tensors(tmp_path, edit, r"q_proj\.lora_A\.weight' has dtype int32")


@pytest.mark.parametrize("dtype", [np.int8, "float64", "fp8"])
def test_unsupported_serve_dtype(tmp_path, dtype):
    base_adapter(tmp_path)
    with pytest.raises(AdapterError, match="dtype=.* is not supported"):
        load_peft_adapter(tmp_path, CFG, dtype=dtype)


def test_adapter_error_is_value_error():
    assert issubclass(AdapterError, ValueError)


@pytest.mark.parametrize("dtype,alpha,std", [
    (np.float32, 1e308, 0.05),   # lora_alpha / r overflows float32: an infinite scale
    (np.float16, 8e5, 100.0),    # A fits float16, B * scale (1e5) x 100 is past its largest value
    ("bfloat16", 8e10, 1e30),    # finite weights whose B * 1e10 overflows bfloat16 (and float32)
])
def test_scaled_weights_that_do_not_fit_the_dtype_are_refused(tmp_path, dtype, alpha, std):
    """An adapter whose A or B * scale is not finite in the pool's dtype is refused when it is
    packed for the pool (at registration), naming the layer and module, before any page holds it."""
    from slora_jax.model.layout import AdapterLayout, pack_adapter
    dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    path = random_peft_adapter(tmp_path / "big", CFG, rank=8, alpha=alpha, std=std, targets=["q_proj"])
    adapter = load_peft_adapter(path, CFG)
    layout = AdapterLayout.of(adapter, CFG, 16)
    with pytest.raises(AdapterError, match=r"layer \d+ q_proj lora_B \* scale .* not finite in"):
        pack_adapter(adapter, layout, CFG, dtype)
    ok = random_peft_adapter(tmp_path / "ok", CFG, rank=8, targets=["q_proj"])  # the same shape, sane
    rows = pack_adapter(load_peft_adapter(ok, CFG), layout, CFG, dtype)
    assert np.isfinite(rows.astype(np.float32)).all()
