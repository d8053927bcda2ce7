"""The pieces of an OpenAI response: `Choice`, one prompt's completion as it streams (text decoded
incrementally, stop strings applied, logprobs kept), `usage` with the cached prompt tokens, and the
logprobs objects of the completions and chat APIs.
"""

from __future__ import annotations

import math

from slora_jax.serve.async_engine import Delta, RequestHandle
from slora_jax.serve.errors import hide_paths


class Choice:
    """One prompt of a request: the tokens generated, and the text sent so far."""

    def __init__(self, index: int, handle: RequestHandle, tokenizer, stop: list[str], logprobs: int | None,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True, min_tokens: int = 0):
        self.index, self.handle, self.tok, self.stop = index, handle, tokenizer, stop
        self.keep_stop, self.skip_special, self.min_tokens = include_stop_str_in_output, skip_special_tokens, min_tokens
        self.first_of_prompt = True  # False for a prompt's 2nd..n-th completion: usage counts a prompt once
        self.want_lp = logprobs
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []  # per token: its top k and itself (logprobs=k)
        self.text = ""
        self.finish_reason: str | None = None   # "error": the model's output was not finite
        self.abort_reason: str | None = None
        self.error = ""
        self.error_code = "non_finite_output"
        self._hold = max((len(s) for s in stop), default=1) - 1  # text held back: a stop string may start there
        self._decoded = ""  # the text of the tokens so far, stop strings not applied
        self._stream = tokenizer.decode_stream(skip_special_tokens) if tokenizer is not None else None

    def feed(self, d: Delta) -> tuple[str, list[int], list[float]]:
        """New text, token ids and logprobs to send for delta `d` (stop strings applied)."""
        n0, t0 = len(self.token_ids), len(self.text)
        if d.logprobs is not None and not all(math.isfinite(x) for x in d.logprobs):
            # NaN or infinity in the model's output (an adapter whose weights overflow): the
            # request ends here, for this client alone; nothing non-finite is ever sent.
            self.finish_reason = "error"
            self.error = (f"the model's output for choice {self.index} is not finite after {n0} tokens; "
                          "the adapter's weights may overflow")
            return "", [], []
        self.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            self.logprobs.extend(d.logprobs)
        if d.top_logprobs is not None:
            self.top_logprobs.extend(d.top_logprobs)
        finished = d.finish_reason is not None
        if finished:
            self.finish_reason, self.abort_reason = d.finish_reason, d.abort_reason
        if d.finish_reason == "error":  # the engine could not serve this request alone
            self.error, self.error_code = hide_paths(d.abort_reason or "the request failed"), d.error_code
        if self._stream is not None:
            # As LLM.generate: a stop token (EOS or stop_token_ids) ends the text, unshown. Only
            # the new tokens are decoded (a window around them), never the whole output.
            shown = d.token_ids[:-1] if d.finish_reason == "stop" else d.token_ids
            self._decoded += self._stream.step(shown)
            if finished:
                self._decoded += self._stream.finish()
            full = self._decoded
            end = len(full)
            if self.stop and len(self.token_ids) >= self.min_tokens:  # as vLLM: none before min_tokens
                floor = self._min_tokens_chars()
                hit = min(((i, s) for s in self.stop
                           if (i := full.find(s, max(0, t0 - len(s), floor - len(s) + 1))) >= 0), default=None)
                if hit is not None:
                    end = hit[0] + len(hit[1]) if self.keep_stop else hit[0]
                    full = full[:end]
                    self.finish_reason, finished = "stop", True
            if not finished:
                end = max(t0, min(end, len(full) - self._hold))
            self.text += full[t0:end]
        return self.text[t0:], self.token_ids[n0:], self.logprobs[n0:]

    def _min_tokens_chars(self) -> int:
        """The text of the first min_tokens - 1 tokens, which a stop string must end past."""
        return len(self.tok.decode(self.token_ids[:self.min_tokens - 1], self.skip_special)) \
            if self.min_tokens > 1 else 0

    def tops(self, n: int, piece) -> list[list[tuple[str, float]]] | None:
        """The top logprobs of the last n tokens, each as [(piece(token), logprob)] best first
        (None when not asked for)."""
        if not self.want_lp or len(self.top_logprobs) < len(self.token_ids):
            return None
        end = len(self.token_ids)
        return [[(piece(t), lp) for t, lp in sorted(d.items(), key=lambda kv: -kv[1])]
                for d in self.top_logprobs[end - n:end]]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def usage(choices: list[Choice]) -> dict:
    p = sum(len(c.handle.prompt) for c in choices if c.first_of_prompt)
    g = sum(len(c.token_ids) for c in choices)
    cached = sum(c.handle.out.num_cached_tokens or 0 for c in choices if c.handle.out is not None)
    return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g,
            "prompt_tokens_details": {"cached_tokens": cached}}


def completion_logprobs(c: Choice, pieces: list[str], lps: list[float], offsets: list[int],
                        tops: list | None = None) -> dict | None:
    """The completions API's logprobs object for tokens shown as `pieces` at text `offsets`;
    tops (Choice.tops): per token its top k and itself, as vLLM's top_logprobs dicts."""
    if c.want_lp is None:
        return None
    if tops is None:
        tops = [[(tok, lp)] for tok, lp in zip(pieces, lps)]
    return {"tokens": pieces, "token_logprobs": list(lps),
            "top_logprobs": [dict(top) for top in tops] if c.want_lp > 0 else None,
            "text_offset": offsets}


def chat_logprobs(c: Choice, pieces: list[str], lps: list[float], tops: list | None = None) -> dict | None:
    """The chat API's logprobs object for tokens shown as `pieces`; each token's top_logprobs are
    the top_logprobs most likely tokens (tops: Choice.tops)."""
    if c.want_lp is None:
        return None
    if tops is None:
        tops = [[(tok, lp)] for tok, lp in zip(pieces, lps)]

    def entry(tok: str, lp: float) -> dict:
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}
    content = [{**entry(tok, lp), "top_logprobs": [entry(*t) for t in top[:c.want_lp]]}
               for tok, lp, top in zip(pieces, lps, tops)]
    return {"content": content}
