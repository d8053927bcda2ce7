"""Text in and out, through the `tokenizers` library, when the model directory has tokenizer.json.
The file is parsed once, here; the chat template, token pieces and streaming decode share it."""

from __future__ import annotations

from pathlib import Path


class Tokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer as HFTokenizer
        self.hf = HFTokenizer.from_file(str(path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> "DecodeStream":
        return DecodeStream(self, skip_special_tokens)


class DecodeStream:
    """Incremental detokenization: `step(ids)` returns the text that `ids`, appended to the tokens
    so far, add. It decodes a small window of recent tokens (`tokenizers.decoders.DecodeStream`),
    never the whole output, and holds back an incomplete UTF-8 sequence until it completes.
    `finish(ids)` returns the text still held back, so that the concatenation of everything
    returned equals `decode(all ids)`."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream as HFDecodeStream
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.stream = HFDecodeStream(skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []
        self.text = ""       # everything returned so far
        self.exact = True    # False once the window decode disagrees with a full decode (then: full decodes)

    def step(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        if not self.exact:
            return self._resync(complete_only=True)
        new = []
        try:
            for t in ids:
                piece = self.stream.step(self.tok.hf, t)
                if piece:
                    new.append(piece)
        except Exception:  # noqa: BLE001 - the tokenizers library's "invalid prefix": decode in full from here
            self.exact = False
            return self._resync(complete_only=True)
        out = "".join(new)
        self.text += out
        return out

    def finish(self) -> str:
        """The rest of the text: what an incomplete or invalid UTF-8 tail held back."""
        return self._resync(complete_only=False)

    def _resync(self, complete_only: bool) -> str:
        full = self.tok.decode(self.ids, self.skip)
        if complete_only:
            full = full.rstrip("\ufffd")  # an incomplete UTF-8 sequence may still complete
        if not full.startswith(self.text):
            self.exact = False
            return ""  # text already sent cannot be taken back
        out = full[len(self.text):]
        self.text = full
        return out


def load_tokenizer(model_dir) -> Tokenizer | None:
    path = Path(model_dir) / "tokenizer.json"
    return Tokenizer(path) if path.is_file() else None
