"""A tiny random Mistral model with sliding-window attention, and its logits over a prompt longer
than the window (the oracle interpreter: torch + transformers).

    python tests/oracle/mistral_window.py OUT_DIR     # OUT_DIR: the model, ids.npy, logits.npy

tests/test_sliding_window.py loads the model into the engine: inside the window its logits must
be the oracle's; past it the oracle's attention differs from full attention, which is why the
engine keeps sequences within the window.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

WINDOW, PROMPT = 16, 24


def main(out: str) -> None:
    cfg = transformers.MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     sliding_window=WINDOW, max_position_embeddings=64, tie_word_embeddings=False)
    model = transformers.MistralForCausalLM(cfg).eval()
    rng = np.random.default_rng(5)
    with torch.no_grad():  # random and nonzero everywhere (norms around 1)
        for name, p in sorted(model.named_parameters()):
            noise = torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype(np.float32))
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.2 * noise)
    model.save_pretrained(out, safe_serialization=True)
    ids = rng.integers(3, cfg.vocab_size, PROMPT)
    with torch.no_grad():
        logits = model(torch.from_numpy(ids)[None]).logits[0].numpy()
    np.save(os.path.join(out, "ids.npy"), ids)
    np.save(os.path.join(out, "logits.npy"), logits)


if __name__ == "__main__":
    main(sys.argv[1])
