"""Text in and out, through the `tokenizers` library, when the model directory has tokenizer.json."""

from __future__ import annotations

from pathlib import Path


class Tokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer as HFTokenizer
        self._tok = HFTokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def load_tokenizer(model_dir) -> Tokenizer | None:
    path = Path(model_dir) / "tokenizer.json"
    return Tokenizer(path) if path.is_file() else None
