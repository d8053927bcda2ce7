"""The OpenAI requests as the server reads them: the body, sampling parameters, prompts, chat
messages and adapter paths, each checked. The error shape is errors.py's; the pieces of a response
are responses.py's.

Requests are plain JSON checked by hand, so every error names its parameter (errors.bad).
`parse_json_body` refuses what the rest of the server cannot take (lone surrogates, NaN, deep
nesting) before any field is read, and every number that reaches the device is range-checked, so
one request can never fail a step shared with others.

Sampling parameters: max_tokens (max_completion_tokens for chat), temperature [0, 2], top_p, seed,
stop (strings), logprobs (completions: int 0..20, the top k and the sampled token; chat: bool +
top_logprobs 0..20, the top k), presence_penalty and frequency_penalty [-2, 2], logit_bias ({token
id: [-100, 100]}), n (completion j of a prompt sampled with seed + j, as SamplingParams.n in
LLM.generate), and vLLM's extensions top_k, min_p, min_tokens, repetition_penalty (0, 10],
stop_token_ids, ignore_eos, include_stop_str_in_output, skip_special_tokens, return_token_ids (adds
`token_ids` and `prompt_token_ids` to each choice), and ttft_slo (seconds: the scheduler aborts the
request, 503, when its first token cannot come in time); echo (completions) and prompt_logprobs
0..20 (scoring.py; max_tokens may then be 0). Chat's echo, best_of > 1, suffix and tools are
refused with 400 rather than silently ignored, and so is every other field of vLLM's
CompletionRequest and ChatCompletionRequest set to anything but its "off" value (fields.py's
REFUSED_FIELDS; docs/openai-api.md has the table). Fields vLLM does not know either are logged and
ignored.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re

from slora_jax.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams
from slora_jax.serve.errors import bad
from slora_jax.serve.fields import REFUSED_FIELDS, SUPPORTED_FIELDS, is_off
from slora_jax.serve.scoring import engine_prompt_logprobs

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024        # the longest stop string
MAX_STOP_TOKEN_IDS = 64
MAX_BATCH_PROMPTS = 256     # prompts times n
MAX_N = 16
MAX_MESSAGES = 1024
MAX_BODY_BYTES = 16 << 20
MAX_JSON_DEPTH = 32          # nesting of objects and lists in a request body
CHARS_PER_TOKEN_LIMIT = 64   # text longer than max_model_len * this is refused before tokenizing
MESSAGE_CHARS = 16           # what a chat template adds per message, at least, counted before rendering
INT32_MAX = 2**31 - 1        # top_k reaches the device as int32
SEED_RANGE = (-(2**63), 2**63 - 1)
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+\-]{0,255}$")
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")

log = logging.getLogger(__name__)

def refuse_unimplemented(body: dict, chat: bool) -> None:
    """A 400 naming the first field vLLM accepts and this server does not implement, when it is
    set to anything but its "off" value; other unknown fields are logged and ignored, as vLLM does."""
    kind = "chat" if chat else "completions"
    refused = REFUSED_FIELDS[kind]
    for name, v in body.items():
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
# field readers

def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def get_int(body: dict, name: str, lo: int | None = None, hi: int | None = None, default=None):
    v = body.get(name)
    if v is None:
        return default
    if not is_int(v):
        raise bad(f"{name} must be an integer, got {json.dumps(v)}", name, "invalid_type")
    if lo is not None and v < lo:
        raise bad(f"{name} must be >= {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise bad(f"{name} must be <= {hi}, got {v}", name)
    return v


def get_number(body: dict, name: str, lo: float, hi: float, default, lo_open: bool = False):
    v = body.get(name)
    if v is None:
        return default
    if not is_number(v):
        raise bad(f"{name} must be a number, got {json.dumps(v)}", name, "invalid_type")
    try:
        v = float(v)
    except OverflowError:  # an integer too large for a float
        v = math.inf
    if not (lo < v if lo_open else lo <= v) or not v <= hi:  # NaN fails both
        raise bad(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v:g}", name)
    return v


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"{name} must be true or false, got {json.dumps(v)}", name, "invalid_type")
    return v


def refuse_unsupported(body: dict, chat: bool) -> None:
    names = (("echo", "echo in chat is"),) if chat else ()  # completions' echo: scoring.py
    for name, what in names + (("suffix", "suffix is"), ("tools", "tools are")):
        if body.get(name):
            raise bad(f"{what} not supported", name, "unsupported_parameter")
    if body.get("best_of") not in (None, 1):
        raise bad("best_of is not supported (only 1)", "best_of", "unsupported_parameter")


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


def sampling_params(body: dict, *, chat: bool, limits: Limits, prompt_lens: list[int],
                    adapter: str | None) -> tuple[SamplingParams, dict]:
    """SamplingParams for every prompt of the request, and the server-side extras (stop strings,
    logprobs wanted, stream, include_usage, return_token_ids)."""
    refuse_unsupported(body, chat)
    refuse_unimplemented(body, chat)
    if chat:
        mt_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    else:
        mt_name = "max_tokens"
    echo, prompt_lp = get_bool(body, "echo"), get_int(body, "prompt_logprobs", 0, MAX_LOGPROBS)  # scoring.py
    max_tokens = get_int(body, mt_name, 0 if echo or prompt_lp is not None else 1, None)
    longest = max(prompt_lens)
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
    elif longest + max_tokens > ctx:
        raise bad(f"This model's maximum context length is {ctx} tokens. However, you requested "
                  f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} for the "
                  f"completion). Please reduce the prompt or {mt_name}.", mt_name, "context_length_exceeded")
    temperature = get_number(body, "temperature", 0.0, 2.0, 1.0)
    top_p = get_number(body, "top_p", 0.0, 1.0, 1.0, lo_open=True)
    top_k = get_int(body, "top_k", -1, INT32_MAX, 0)
    seed = get_int(body, "seed", *SEED_RANGE)
    ignore_eos = get_bool(body, "ignore_eos")
    ttft_slo = get_number(body, "ttft_slo", 0.0, 3600.0, None, lo_open=True)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(is_int(t) and 0 <= t < limits.vocab for t in stop_ids):
            raise bad(f"stop_token_ids must be a list of token ids in [0, {limits.vocab})", "stop_token_ids")
        if len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise bad(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids", "stop_token_ids")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop must be a non-empty string or a list of non-empty strings", "stop", "invalid_type")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise bad(f"a stop string may have at most {MAX_STOP_CHARS} characters", "stop")
    if chat:
        want_lp = get_bool(body, "logprobs")
        top_lp = get_int(body, "top_logprobs", 0, MAX_LOGPROBS)
        if top_lp is not None and not want_lp:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        lp = (top_lp or 0) if want_lp else None
    else:
        lp = get_int(body, "logprobs", 0, MAX_LOGPROBS)
    n = get_int(body, "n", 1, MAX_N, 1)
    if n * len(prompt_lens) > MAX_BATCH_PROMPTS:
        raise bad(f"{len(prompt_lens)} prompts times n={n} is over {MAX_BATCH_PROMPTS} completions per request", "n")
    stream = get_bool(body, "stream")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise bad("stream_options must be an object", "stream_options", "invalid_type")
    include_usage = bool(so and get_bool(so, "include_usage"))
    try:
        sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, stop_token_ids=stop_ids, logprobs=lp if lp is not None else False,
                            ignore_eos=ignore_eos, **sampling_extras(body, limits.vocab, max_tokens),
                            prompt_logprobs=engine_prompt_logprobs(echo, prompt_lp, lp, max_tokens),
                            **({"ttft_slo": ttft_slo} if ttft_slo is not None else {}))
    except ValueError as e:  # anything the checks above missed
        raise bad(str(e)) from None
    return sp, dict(stop=stop, logprobs=lp, stream=stream, include_usage=include_usage, n=n, echo=echo,
                    prompt_logprobs=prompt_lp,
                    return_token_ids=get_bool(body, "return_token_ids"),
                    include_stop_str_in_output=get_bool(body, "include_stop_str_in_output"),
                    skip_special_tokens=get_bool(body, "skip_special_tokens", True))


def sampling_extras(body: dict, vocab: int, max_tokens: int) -> dict:
    """min_p, min_tokens, the penalties and logit_bias, range-checked (SamplingParams' fields)."""
    return dict(min_p=get_number(body, "min_p", 0.0, 1.0, 0.0),
                min_tokens=get_int(body, "min_tokens", 0, max_tokens, 0),
                presence_penalty=get_number(body, "presence_penalty", -2.0, 2.0, 0.0),
                frequency_penalty=get_number(body, "frequency_penalty", -2.0, 2.0, 0.0),
                repetition_penalty=get_number(body, "repetition_penalty", 0.0, 10.0, 1.0, lo_open=True),
                logit_bias=logit_bias(body, vocab))


def logit_bias(body: dict, vocab: int) -> dict[int, float] | None:
    """OpenAI's logit_bias: {token id as a string: bias in [-100, 100]}, ids in the vocabulary."""
    v = body.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad("logit_bias must be an object mapping token ids to biases", "logit_bias", "invalid_type")
    if len(v) > MAX_LOGIT_BIAS:
        raise bad(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries", "logit_bias")
    out = {}
    for key, bias in v.items():
        if not (key.isascii() and key.isdigit() and int(key) < vocab):
            raise bad(f"logit_bias keys must be token ids in [0, {vocab}), got {json.dumps(key)}", "logit_bias")
        if not is_number(bias) or not -100 <= bias <= 100:
            raise bad(f"logit_bias values must be numbers in [-100, 100], got {json.dumps(bias)}", "logit_bias")
        out[int(key)] = float(bias)
    return out


# ---------------------------------------------------------------------------------------------
# prompts and adapter paths

def tokenize_prompt(prompt, param: str, tokenizer, limits: Limits) -> list[int]:
    """One prompt, text or token ids, as token ids inside the model's vocabulary."""
    if isinstance(prompt, str):
        if not prompt:
            raise bad("the prompt is empty", param)
        if tokenizer is None:
            raise bad("this model has no tokenizer.json: send token ids", param)
        if len(prompt) > limits.max_model_len * CHARS_PER_TOKEN_LIMIT:
            raise bad(f"the prompt of {len(prompt)} characters is far over the maximum context length "
                      f"of {limits.max_model_len} tokens", param, "context_length_exceeded")
        return tokenizer.encode(prompt)
    if not prompt:
        raise bad("the prompt is empty", param)
    if not all(is_int(t) for t in prompt):
        raise bad("a token-id prompt must be a list of integers", param, "invalid_type")
    v = limits.vocab
    if not all(0 <= t < v for t in prompt):
        raise bad(f"token ids must be in [0, {v})", param)
    return list(prompt)


def parse_prompts(body: dict, tokenizer, limits: Limits) -> list[list[int]]:
    """The completions API's `prompt`: str | [str] | [int] | [[int]], as lists of token ids."""
    p = body.get("prompt")
    if isinstance(p, str):
        return [tokenize_prompt(p, "prompt", tokenizer, limits)]
    if isinstance(p, list) and p and all(is_int(t) for t in p):
        return [tokenize_prompt(p, "prompt", tokenizer, limits)]
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        if len(p) > MAX_BATCH_PROMPTS:
            raise bad(f"at most {MAX_BATCH_PROMPTS} prompts per request", "prompt")
        return [tokenize_prompt(x, f"prompt[{i}]", tokenizer, limits) for i, x in enumerate(p)]
    if p is None:
        raise bad("prompt is required", "prompt", "missing_required_parameter")
    if isinstance(p, list) and not p:
        raise bad("the prompt is empty", "prompt")
    raise bad("prompt must be a string, a list of strings, a list of token ids or a list of lists of "
              "token ids", "prompt", "invalid_type")


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

def parse_messages(body: dict) -> list[dict]:
    """`messages` as [{"role", "content", "name"?}], text parts joined into one string."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages must be a non-empty list", "messages", "invalid_type")
    if len(msgs) > MAX_MESSAGES:
        raise bad(f"at most {MAX_MESSAGES} messages per request, got {len(msgs)}", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object", where, "invalid_type")
        role = m.get("role")
        if role not in MESSAGE_ROLES:
            raise bad(f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}; got {json.dumps(role)}",
                      f"{where}.role")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise bad(f"{where}.content[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                              "are supported", f"{where}.content", "invalid_type")
                parts.append(p["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise bad(f"{where}.content must be a string or a list of text parts", f"{where}.content",
                      "invalid_type")
        msg = {"role": role, "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    if all(not m["content"] for m in out):
        raise bad("messages are all empty", "messages")
    return out


def message_chars(messages: list[dict]) -> int:
    """The characters a chat prompt has at least: every role, name and content, and what the
    template adds around each message."""
    return sum(len(m["role"]) + len(m["content"]) + len(m.get("name", "")) + MESSAGE_CHARS for m in messages)
