"""Build the parity fixtures: two tiny random Hugging Face Llama models and PEFT LoRA adapters.

Runs in the ORACLE interpreter (torch + transformers + peft), never in the engine's.

    python tests/oracle/build_fixtures.py OUT_DIR      # writes OUT_DIR/manifest.json

Layout written under OUT_DIR:

    models/mha/                 config.json + model.safetensors (as transformers saves them)
    models/gqa/                 idem (tied embeddings, llama3 rope scaling)
    models/gqa_legacy/          the same weights as gqa, config.json rewritten in the
                                transformers-4 style of real Llama-3 checkpoints
                                (top-level rope_theta + rope_scaling instead of rope_parameters)
    adapters/<model>/<adapter>/ adapter_config.json + adapter_model.safetensors (PEFT)
    manifest.json

Every weight is random and nonzero, drawn from numpy's PCG64 with fixed seeds (stable across
machines and torch versions). PEFT initialises lora_B to zero; we overwrite both A and B with
random values, or an engine that ignored LoRA entirely would pass.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np  # noqa: E402
import torch  # noqa: E402

SEED = 3  # chosen so that every greedy step of the oracle is clear (top-1 minus top-2 logit > 5e-3)

MODELS: dict[str, dict] = {
    "mha": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
    ),
    "gqa": dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=256,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    ),
}

# name -> LoraConfig kwargs. Scales (alpha/r, or alpha/sqrt(r) with rslora):
#   r8_qv 2.0; r4_all 2.0; r16_rslora 4.0; pattern: q 1.0, down (r=2) 4.0, up (alpha 32) 4.0; layers 2.0
ADAPTERS: dict[str, dict] = {
    "r8_qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "r4_all": dict(r=4, lora_alpha=8, target_modules="all-linear"),
    "r16_rslora": dict(r=16, lora_alpha=16, use_rslora=True,
                       target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "pattern": dict(r=8, lora_alpha=8, target_modules=r".*\.(q_proj|down_proj|up_proj)",
                    rank_pattern={"down_proj": 2}, alpha_pattern={"up_proj": 32}),
    "layers": dict(r=2, lora_alpha=4, target_modules=["gate_proj", "o_proj"],
                   layers_to_transform=[1], layers_pattern="layers"),
}

# Standard deviations of the random weights, per model: (projection matrices, embeddings and lm_head).
# gqa ties lm_head to the embeddings, so the input embedding of the last token is a strong vote for
# itself; larger projections keep its greedy continuations from just repeating the last token.
INIT_STD = {"mha": (0.1, 0.3), "gqa": (0.2, 0.3)}
NORM_STD = 0.1    # norm weights are 1 + NORM_STD * randn
LORA_STD = 0.1    # lora_A and lora_B


def _randn(rng: np.random.Generator, shape, std: float) -> torch.Tensor:
    return torch.from_numpy((rng.standard_normal(shape) * std).astype(np.float32))


def _randomise_base(model, rng: np.random.Generator, base_std: float, embed_std: float) -> None:
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.copy_(1.0 + _randn(rng, tuple(p.shape), NORM_STD))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(_randn(rng, tuple(p.shape), embed_std))
            else:
                p.copy_(_randn(rng, tuple(p.shape), base_std))
        for name, p in model.named_parameters():
            if not torch.all(p != 0):
                raise AssertionError(f"base weight {name} has zeros")


def _randomise_lora(peft_model, rng: np.random.Generator) -> int:
    n = 0
    with torch.no_grad():
        for name, p in sorted(peft_model.named_parameters()):
            if "lora_A" in name or "lora_B" in name:
                p.copy_(_randn(rng, tuple(p.shape), LORA_STD))
                n += 1
    if n == 0:
        raise AssertionError("no LoRA parameters found to randomise")
    return n


def build_model(name: str, out: Path, seed: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**MODELS[name], bos_token_id=1, eos_token_id=2, attn_implementation="eager")
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    _randomise_base(model, np.random.default_rng(seed), *INIT_STD[name])
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    d = out / "models" / name
    model.save_pretrained(d, safe_serialization=True)
    return d


def write_legacy_copy(src: Path, dst: Path) -> Path:
    """The same weights, config.json in the transformers-4 layout (top-level rope_theta/rope_scaling)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json":
            shutil.copy2(f, dst / f.name)
    d = json.loads((src / "config.json").read_text())
    rp = d.pop("rope_parameters", None)
    if rp is not None:
        rp = dict(rp)
        d["rope_theta"] = rp.pop("rope_theta")
        d["rope_scaling"] = rp if rp.get("rope_type", "default") != "default" else None
    (dst / "config.json").write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
    return dst


def build_adapter(model_dir: Path, adapter: str, out: Path, seed: int) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    cfg = LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, bias="none", **ADAPTERS[adapter])
    pm = get_peft_model(base, cfg)
    _randomise_lora(pm, np.random.default_rng(seed))
    d = out / "adapters" / model_dir.name / adapter
    pm.save_pretrained(d, safe_serialization=True)
    return d


def build_all(out: Path | str) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_default_dtype(torch.float32)
    manifest: dict = {"seed": SEED, "models": {}, "adapters": {}, "aliases": {}}
    for mi, name in enumerate(MODELS):
        mdir = build_model(name, out, SEED + 1000 * mi)
        manifest["models"][name] = str(mdir)
        manifest["adapters"][name] = {}
        for ai, adapter in enumerate(ADAPTERS):
            adir = build_adapter(mdir, adapter, out, SEED + 1000 * mi + 10 * (ai + 1))
            manifest["adapters"][name][adapter] = str(adir)
    legacy = write_legacy_copy(Path(manifest["models"]["gqa"]), out / "models" / "gqa_legacy")
    # An alias is a second directory holding the same model (same oracle outputs).
    manifest["aliases"]["gqa_legacy"] = {"path": str(legacy), "same_as": "gqa"}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="output directory")
    args = ap.parse_args(argv)
    m = build_all(args.out)
    print(json.dumps(m, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
