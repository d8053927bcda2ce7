"""Tiny random models of the Llama family's other members, each with a PEFT LoRA adapter on
every projection, and their logits over one prompt with and without the adapter (the oracle
interpreter: torch + transformers + peft).

    python tests/oracle/families.py OUT_DIR

OUT_DIR/<name>/model, OUT_DIR/<name>/adapter, OUT_DIR/<name>/{ids,base,lora}.npy for
- qwen2: Qwen2ForCausalLM (q, k and v have a bias; GQA, tied embeddings);
- llama_bias: LlamaForCausalLM with attention_bias and mlp_bias (every projection has one);
- qwen3: Qwen3ForCausalLM (an RMSNorm over each head's q and k; head_dim apart from hidden / heads).
tests/test_model_families.py serves them through the engine.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np  # noqa: E402
import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODELS = {
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **SHAPE, tie_word_embeddings=True, use_sliding_window=False, rope_theta=1e6)),
    "llama_bias": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SHAPE, attention_bias=True, mlp_bias=True, tie_word_embeddings=False)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **SHAPE, head_dim=32, tie_word_embeddings=False, use_sliding_window=False, rope_theta=1e6)),
}


def build(name: str, out: str, seed: int) -> None:
    model = MODELS[name]().eval()
    rng = np.random.default_rng(seed)
    with torch.no_grad():  # random and nonzero everywhere, biases included (norms around 1)
        for pname, p in sorted(model.named_parameters()):
            noise = torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype(np.float32))
            p.copy_(1 + 0.1 * noise if "norm" in pname else 0.2 * noise)
    model.save_pretrained(os.path.join(out, "model"), safe_serialization=True)
    ids = torch.from_numpy(rng.integers(3, SHAPE["vocab_size"], 12))[None]
    torch.manual_seed(seed)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                      init_lora_weights=False))
    lora.save_pretrained(os.path.join(out, "adapter"))
    with torch.no_grad():
        with lora.disable_adapter():
            base = lora(ids).logits[0].numpy()
        with_lora = lora(ids).logits[0].numpy()
    np.save(os.path.join(out, "ids.npy"), ids[0].numpy())
    np.save(os.path.join(out, "base.npy"), base)
    np.save(os.path.join(out, "lora.npy"), with_lora)


def main(out: str) -> None:
    for seed, name in enumerate(MODELS):
        build(name, os.path.join(out, name), seed)


if __name__ == "__main__":
    main(sys.argv[1])
