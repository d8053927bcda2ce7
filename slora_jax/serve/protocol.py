"""The OpenAI requests as the server reads them, after their models (schema.py) have validated
each body's shape, types and static bounds: what needs the model, the pool or the server's state.
The error shape is errors.py's; the pieces of a response are responses.py's.

`parse_json_body` refuses what the rest of the server cannot take (lone surrogates, NaN, deep
nesting, a body that is not an object) before the body meets its model. On the validated model,
this module checks what no static schema can state: token ids (prompts, stop_token_ids, logit_bias
keys) within the vocabulary, prompt + max_tokens within the context length, the default max_tokens
(what fits the pool), n x prompts <= MAX_BATCH_PROMPTS, min_tokens <= max_tokens, max_tokens 0
only with echo or prompt_logprobs, top_logprobs only with logprobs, the characters of a prompt or
a chat before tokenizing, and adapter paths (check_adapter_path). Every error is a 400 that names
its parameter (errors.bad), and every number that reaches the device has been range-checked, so
one request can never fail a step shared with others.

Sampling parameters: max_tokens (max_completion_tokens for chat), temperature [0, 2], top_p, seed,
stop (strings), logprobs (completions: int 0..20, the top k and the sampled token; chat: bool +
top_logprobs 0..20, the top k), presence_penalty and frequency_penalty [-2, 2], logit_bias ({token
id: [-100, 100]}), n (completion j of a prompt sampled with seed + j, as SamplingParams.n in
LLM.generate), and vLLM's extensions top_k, min_p, min_tokens, repetition_penalty (0, 10],
stop_token_ids, ignore_eos, include_stop_str_in_output, skip_special_tokens, return_token_ids (adds
`token_ids` and `prompt_token_ids` to each choice), and ttft_slo (seconds: the scheduler aborts the
request, 503, when its first token cannot come in time); echo (completions) and prompt_logprobs
0..20 (scoring.py; max_tokens may then be 0). A field the request leaves out takes SamplingParams'
default. Chat's echo, best_of > 1, suffix and tools are refused with 400 rather than silently
ignored, and so is every other field of vLLM's CompletionRequest and ChatCompletionRequest set to
anything but its "off" value (fields.py's REFUSED_FIELDS; docs/openai-api.md has the table). Fields
vLLM does not know either are logged and ignored.
"""

from __future__ import annotations

import json
import logging
import os
import re

from slora_jax.sampling import SamplingParams
from slora_jax.serve.errors import bad
from slora_jax.serve.fields import REFUSED_FIELDS, SUPPORTED_FIELDS, is_off
from slora_jax.serve.schema import MAX_BATCH_PROMPTS, ChatCompletionRequest, CompletionRequest, SamplingFields
from slora_jax.serve.scoring import engine_prompt_logprobs

MAX_BODY_BYTES = 16 << 20
MAX_JSON_DEPTH = 32          # nesting of objects and lists in a request body
CHARS_PER_TOKEN_LIMIT = 64   # text longer than max_model_len * this is refused before tokenizing
MESSAGE_CHARS = 16           # what a chat template adds per message, at least, counted before rendering

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# the body

SURROGATE = re.compile("[\ud800-\udfff]")


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_json_body(raw: bytes) -> dict:
    """A request body as a JSON object: valid UTF-8 and JSON without NaN or Infinity, nested at most
    MAX_JSON_DEPTH deep, and no lone surrogates (escaped "\\ud800" halves that no UTF-8 text holds,
    which the tokenizer and the response encoder cannot take). Anything else is a 400."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise bad(f"the request body is nested deeper than {MAX_JSON_DEPTH} levels", None, "invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, "invalid_json")
    stack = [(body, 1, None)]
    while stack:  # iterative: a deep body must not exhaust Python's stack here either
        value, depth, param = stack.pop()
        if isinstance(value, str):
            if SURROGATE.search(value):
                raise bad("a string in the request body holds a lone UTF-16 surrogate (malformed Unicode)",
                          param, "invalid_unicode")
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise bad(f"the request body is nested deeper than {MAX_JSON_DEPTH} levels", None, "invalid_json")
        if isinstance(value, dict):
            for k, v in value.items():
                top = k if depth == 1 else param
                if SURROGATE.search(k):
                    raise bad("a key in the request body holds a lone UTF-16 surrogate (malformed Unicode)",
                              param, "invalid_unicode")
                stack.append((v, depth + 1, top))
        else:
            stack.extend((v, depth + 1, param) for v in value)
    return body


# ---------------------------------------------------------------------------------------------
# fields the models do not declare

def refuse_unsupported(extra: dict, chat: bool) -> None:
    """A 400 for chat's echo, suffix, tools or best_of > 1, which vLLM reads and this server does not do."""
    names = (("echo", "echo in chat is"),) if chat else ()  # completions' echo: scoring.py
    for name, what in names + (("suffix", "suffix is"), ("tools", "tools are")):
        if extra.get(name):
            raise bad(f"{what} not supported", name, "unsupported_parameter")
    if extra.get("best_of") not in (None, 1):
        raise bad("best_of is not supported (only 1)", "best_of", "unsupported_parameter")


def refuse_unimplemented(extra: dict, chat: bool) -> None:
    """A 400 naming the first field vLLM accepts and this server does not implement, when it is
    set to anything but its "off" value; other unknown fields are logged and ignored, as vLLM does."""
    kind = "chat" if chat else "completions"
    refused = REFUSED_FIELDS[kind]
    for name, v in extra.items():
        if name in SUPPORTED_FIELDS[kind]:
            continue
        if name in refused:
            if not is_off(v, refused[name]):
                raise bad(f"{name} is not supported by this server (allowed: "
                          f"{', '.join([json.dumps(o) for o in refused[name]] + ['null'])})",
                          name, "unsupported_parameter")
        else:
            log.warning("ignoring unknown field %r in a %s request", name, kind)


# ---------------------------------------------------------------------------------------------
# sampling parameters

class Limits:
    """What a request may ask for, from the model and the pool (fixed once the LLM is built)."""

    def __init__(self, llm):
        self.max_model_len = llm.max_model_len
        self.vocab = llm.cfg.vocab_size
        self.pool = llm.engine.pool
        self.kv_pages_for = llm.engine.kv_pages_for
        self.store = llm.store

    def max_new_tokens(self, prompt_len: int, adapter: str | None) -> int:
        """The most tokens a prompt may ask for: the context length, and what fits the pool alone."""
        entry = self.store.entries.get(adapter) if adapter else None
        pages = self.pool.kv_capacity(entry.layout.pages if entry else 0)
        lo, hi = 0, max(self.max_model_len - prompt_len, 0)
        while lo < hi:  # the largest n with kv_pages_for(prompt_len + n) <= pages
            mid = (lo + hi + 1) // 2
            if self.kv_pages_for(prompt_len + mid) <= pages:
                lo = mid
            else:
                hi = mid - 1
        return lo


ENGINE_FIELDS = ("temperature", "top_p", "top_k", "seed", "ignore_eos", "ttft_slo", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty")  # SamplingParams' own, passed as validated


def sampling_params(req: SamplingFields, *, chat: bool, limits: Limits, prompt_lens: list[int],
                    adapter: str | None) -> tuple[SamplingParams, dict]:
    """SamplingParams for every prompt of the request, and the server-side extras (stop strings,
    logprobs wanted, stream, include_usage, return_token_ids)."""
    extra = req.model_extra or {}
    refuse_unsupported(extra, chat)
    refuse_unimplemented(extra, chat)
    echo = not chat and bool(req.echo)
    max_tokens = max_tokens_of(req, chat, echo, limits, max(prompt_lens), adapter)
    if req.min_tokens is not None and req.min_tokens > max_tokens:
        raise bad(f"min_tokens must be <= max_tokens ({max_tokens}), got {req.min_tokens}", "min_tokens")
    if req.stop_token_ids is not None and any(t >= limits.vocab for t in req.stop_token_ids):
        raise bad(f"stop_token_ids must be token ids in [0, {limits.vocab})", "stop_token_ids")
    lp = logprobs_of(req, chat)
    n = req.n or 1
    if n * len(prompt_lens) > MAX_BATCH_PROMPTS:
        raise bad(f"{len(prompt_lens)} prompts times n={n} is over {MAX_BATCH_PROMPTS} completions per request", "n")
    given = {k: v for k in ENGINE_FIELDS if (v := getattr(req, k)) is not None}
    try:
        sp = SamplingParams(max_tokens=max_tokens, stop_token_ids=req.stop_token_ids, min_tokens=req.min_tokens or 0,
                            logprobs=lp if lp is not None else False, logit_bias=logit_bias(req.logit_bias, limits.vocab),
                            prompt_logprobs=engine_prompt_logprobs(echo, req.prompt_logprobs, lp, max_tokens), **given)
    except ValueError as e:  # anything the checks above missed
        raise bad(str(e)) from None
    stop = [req.stop] if isinstance(req.stop, str) else req.stop or []
    so = req.stream_options
    return sp, dict(stop=stop, logprobs=lp, stream=bool(req.stream), include_usage=bool(so and so.include_usage),
                    n=n, echo=echo, prompt_logprobs=req.prompt_logprobs, return_token_ids=bool(req.return_token_ids),
                    include_stop_str_in_output=bool(req.include_stop_str_in_output),
                    skip_special_tokens=req.skip_special_tokens is not False)


def max_tokens_of(req: SamplingFields, chat: bool, echo: bool, limits: Limits, longest: int,
                  adapter: str | None) -> int:
    """The request's max_tokens (chat: max_completion_tokens, else max_tokens) within the context
    length, or its default: 16 for completions, for chat what fits the context and the pool."""
    mt_name = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(req, mt_name)
    ctx = limits.max_model_len
    prompt_param = "messages" if chat else "prompt"
    if longest >= ctx:
        raise bad(f"This model's maximum context length is {ctx} tokens, but the prompt has {longest} tokens",
                  prompt_param, "context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(16, ctx - longest) if not chat else limits.max_new_tokens(longest, adapter)
        if max_tokens < 1:
            raise bad(f"the prompt of {longest} tokens leaves no room to generate in the pool",
                      prompt_param, "context_length_exceeded")
        return max_tokens
    if max_tokens == 0 and not echo and req.prompt_logprobs is None:
        raise bad(f"{mt_name} must be >= 1 (0 only with echo or prompt_logprobs)", mt_name)
    if longest + max_tokens > ctx:
        raise bad(f"This model's maximum context length is {ctx} tokens. However, you requested "
                  f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} for the "
                  f"completion). Please reduce the prompt or {mt_name}.", mt_name, "context_length_exceeded")
    return max_tokens


def logprobs_of(req: SamplingFields, chat: bool) -> int | None:
    """The top logprobs wanted per token: completions' logprobs k; chat's top_logprobs (0 when
    omitted) with logprobs: true; None when the request asks for none."""
    if not chat:
        return req.logprobs
    if req.top_logprobs is not None and not req.logprobs:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def logit_bias(bias: dict[str, float] | None, vocab: int) -> dict[int, float] | None:
    """OpenAI's logit_bias, {token id as a string: bias}, keyed by token ids in the vocabulary."""
    if bias is None:
        return None
    for key in bias:
        if not (key.isascii() and key.isdigit() and int(key) < vocab):
            raise bad(f"logit_bias keys must be token ids in [0, {vocab}), got {json.dumps(key)}", "logit_bias")
    return {int(key): b for key, b in bias.items()}


# ---------------------------------------------------------------------------------------------
# prompts and adapter paths

def tokenize_prompt(prompt: str | list[int], param: str, tokenizer, limits: Limits) -> list[int]:
    """One prompt, text or token ids, as token ids inside the model's vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise bad("this model has no tokenizer.json: send token ids", param)
        if len(prompt) > limits.max_model_len * CHARS_PER_TOKEN_LIMIT:
            raise bad(f"the prompt of {len(prompt)} characters is far over the maximum context length "
                      f"of {limits.max_model_len} tokens", param, "context_length_exceeded")
        return tokenizer.encode(prompt)
    if any(t >= limits.vocab for t in prompt):
        raise bad(f"token ids must be in [0, {limits.vocab})", param)
    return list(prompt)


def prompt_ids(req: CompletionRequest, tokenizer, limits: Limits) -> list[list[int]]:
    """The completions API's `prompt` (str | [int] | [str | [int]]) as lists of token ids."""
    p = req.prompt
    if isinstance(p, str) or isinstance(p[0], int):
        return [tokenize_prompt(p, "prompt", tokenizer, limits)]
    return [tokenize_prompt(x, f"prompt[{i}]", tokenizer, limits) for i, x in enumerate(p)]


def check_adapter_path(path: str, allowed: list[str]) -> str:
    """The real path of an adapter directory inside one of the `allowed` real paths; 400 otherwise."""
    if not allowed:
        raise bad("loading adapters at run time is disabled: start the server with --allowed-adapter-dirs",
                  "lora_path", "path_not_allowed")
    if "\x00" in path:
        raise bad("lora_path contains a NUL byte", "lora_path", "path_not_allowed")
    real = os.path.realpath(path)

    def inside(p: str) -> bool:
        return any(os.path.commonpath([p, root]) == root for root in allowed)

    if not inside(real):
        raise bad(f"lora_path {path!r} is not inside --allowed-adapter-dirs (symlinks and '..' are "
                  "resolved first)", "lora_path", "path_not_allowed")
    if not os.path.isdir(real):
        raise bad(f"lora_path {path!r} is not a directory", "lora_path", "invalid_adapter")
    for f in os.listdir(real):  # a file inside that links out is refused too
        if not inside(os.path.realpath(os.path.join(real, f))):
            raise bad(f"lora_path {path!r}: {f} links outside --allowed-adapter-dirs", "lora_path",
                      "path_not_allowed")
    return real


# ---------------------------------------------------------------------------------------------
# chat messages

def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """`messages` as [{"role", "content", "name"?}], text parts joined into one string and an
    assistant's missing content empty."""
    out = []
    for m in req.messages:
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        out.append({"role": m.role, "content": content, **({"name": m.name} if m.name is not None else {})})
    if all(not m["content"] for m in out):
        raise bad("messages are all empty", "messages")
    return out


def message_chars(messages: list[dict]) -> int:
    """The characters a chat prompt has at least: every role, name and content, and what the
    template adds around each message."""
    return sum(len(m["role"]) + len(m["content"]) + len(m.get("name", "")) + MESSAGE_CHARS for m in messages)
