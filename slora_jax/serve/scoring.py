"""`echo` and `prompt_logprobs` on the OpenAI endpoints, with vLLM's meanings: what scoring
clients (lm-evaluation-harness: echo=true, logprobs=k, max_tokens=0) read.

- completions `echo`: each choice's text starts with its prompt's text (a text prompt as sent, a
  token-id prompt decoded); with `logprobs`, the choice's logprobs cover the prompt's tokens first
  (the first one's token_logprob and top_logprobs null: nothing comes before it), then the
  generated ones. max_tokens may then be 0: the prompt alone comes back.
- `prompt_logprobs=k` (completions and chat): per prompt position, null first, then {token id:
  {"logprob", "rank", "decoded_token"}} of the k most likely tokens and the prompt token; on each
  choice for completions, at the response's top level for chat (as vLLM). max_tokens may be 0.
- chat `echo` (vLLM: repeat the last message when continuing it) is refused with a 400.

schema.py declares the two fields and protocol.sampling_params reads them (engine_prompt_logprobs:
what the engine computes). A stream carries both on each choice's first chunk. The engine computes
the prompt's logprobs (SamplingParams.prompt_logprobs, at the larger of prompt_logprobs and, with
echo, logprobs); they are complete on the RequestOutput once its first token (or its end) has
reached the server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slora_jax.serve.responses import Choice


def engine_prompt_logprobs(echo: bool, prompt_logprobs: int | None, logprobs: int | None,
                           max_tokens: int) -> int | None:
    """SamplingParams.prompt_logprobs of a request: the field's k, and with echo and logprobs the
    echoed prompt's top `logprobs` too; echo with max_tokens=0 and neither asks for k=0 (a request
    that generates nothing is a scoring request for the engine)."""
    if echo and logprobs is not None:
        return max(prompt_logprobs or 0, logprobs)
    if echo and prompt_logprobs is None and max_tokens == 0:
        return 0
    return prompt_logprobs


def text_offsets(tokenizer, ids: list[int], start: int) -> list[int]:
    """Each token's character offset in a text that starts at `start` (completions' text_offset):
    the lengths of the tokens decoded one by one (all 0 without a tokenizer)."""
    offsets, at = [], start
    for t in ids:
        offsets.append(at)
        at += len(tokenizer.decode([t])) if tokenizer is not None else 0
    return offsets


def best(entry: dict[int, float], k: int, token: int) -> list[tuple[int, float]]:
    """The k most likely tokens of a prompt position's entry and the prompt token, best first."""
    top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
    if all(t != token for t, _ in top):
        top.append((token, entry[token]))
    return sorted(top, key=lambda kv: -kv[1])


class PromptPart:
    """What echo and prompt_logprobs add to one request's choices. srv: the app's Server (its
    piece() and tokenizer); prompt: the completions request's `prompt` as sent (None for chat);
    prompts: the token ids of each prompt, n completions each."""

    def __init__(self, srv, prompt, prompts: list[list[int]], extras: dict):
        self.srv, self.n = srv, extras["n"]
        self.echo, self.k = extras["echo"], extras["prompt_logprobs"]
        self.texts = self._texts(prompt, prompts, extras["skip_special_tokens"]) if self.echo else None
        self.sent: set[int] = set()  # streams: the choices whose first chunk went out

    def _texts(self, p, prompts: list[list[int]], skip_special: bool) -> list[str]:
        tok = self.srv.llm.tokenizer
        raw = [p] if isinstance(p, str) or all(isinstance(t, int) for t in p) else p
        return [x if isinstance(x, str) else tok.decode(ids, skip_special) if tok is not None else ""
                for x, ids in zip(raw, prompts)]

    def offset(self, c: Choice) -> int:
        """Where the generated text starts in the choice's text."""
        return len(self.texts[c.index // self.n]) if self.echo else 0

    def first(self, c: Choice, ch: dict, chat: bool) -> dict:
        """A choice's whole response or its stream's first chunk `ch`, with the prompt's part
        added; returns what goes at the response's (chunk's) top level."""
        self.sent.add(c.index)
        if chat:
            return {"prompt_logprobs": self.prompt_logprobs(c)} if self.k is not None else {}
        if self.echo:
            ch["text"] = self.texts[c.index // self.n] + ch["text"]
            if ch["logprobs"] is not None:
                ch["logprobs"] = {key: _join(v, ch["logprobs"][key]) for key, v in self.echo_logprobs(c).items()}
        if self.k is not None:
            ch["prompt_logprobs"] = self.prompt_logprobs(c)
        return {}

    def _positions(self, c: Choice):
        """(prompt token, its entry, its rank) per prompt position after the first."""
        out, ids = c.handle.out, c.handle.prompt
        entries, ranks = out.prompt_logprobs or [None], out.prompt_ranks or [None]
        return [(t, entries[q], ranks[q]) for q, t in enumerate(ids) if 0 < q < len(entries)]

    def echo_logprobs(self, c: Choice) -> dict:
        """The completions logprobs object of the prompt's tokens."""
        ids, piece = c.handle.prompt, self.srv.piece
        offsets = text_offsets(self.srv.llm.tokenizer, ids, 0)
        rest = self._positions(c)
        tops = [None] + [{piece(x): lp for x, lp in best(e, c.want_lp, t)} for t, e, _ in rest]
        return {"tokens": [piece(t) for t in ids], "token_logprobs": [None] + [e[t] for t, e, _ in rest],
                "top_logprobs": tops if c.want_lp > 0 else None, "text_offset": offsets}

    def prompt_logprobs(self, c: Choice) -> list:
        """vLLM's prompt_logprobs list of the choice's prompt."""
        piece = self.srv.piece
        return [None] + [{x: {"logprob": lp, "rank": rank if x == t else i + 1, "decoded_token": piece(x)}
                          for i, (x, lp) in enumerate(best(e, self.k, t))} for t, e, rank in self._positions(c)]


def _join(prompt_part, generated):
    """A logprobs list of the prompt's tokens, then the generated ones' (None when either is)."""
    return None if prompt_part is None or generated is None else prompt_part + generated
