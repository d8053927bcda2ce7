"""What a request carries in (`Request`: its tokens, adapter and progress, the scheduler's unit;
`LoRARequest`: which adapter, as vLLM names it), what one step runs (`Plan`), and what comes back
out (`RequestOutput`, whose `outputs[0]` is a `CompletionOutput`, as in vLLM)."""

from __future__ import annotations

import dataclasses
import itertools

from slora_jax.sampling import SamplingParams

_ids = itertools.count()


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter as vLLM's `LoRARequest` names it: `lora_name` is the name requests use,
    `lora_int_id` a positive integer id, `lora_path` the PEFT directory. `LLM.generate` registers
    the adapter on its first use and again when the same name comes with another path."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        object.__setattr__(self, "lora_path", str(self.lora_path))


@dataclasses.dataclass
class CompletionOutput:
    """One generated sequence of a request (vLLM's `CompletionOutput`). `logprobs` holds the
    sampled token's logprob per position (None unless SamplingParams.logprobs is set);
    `top_logprobs` per position {token id: logprob} of the k most likely tokens and the sampled one
    (SamplingParams.logprobs=k >= 1, else None: vLLM's logprobs dicts);
    `stop_reason` is the stop token id or stop string that ended it (None: EOS or the length)."""
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[float] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    top_logprobs: list[dict[int, float]] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """A request's result. The engine fills the flat fields (`token_ids`, `logprobs`, `text`,
    `finish_reason`) as tokens arrive; `outputs` presents them as vLLM's list of CompletionOutputs,
    whose lists are the same objects as the flat ones. With SamplingParams.n > 1, LLM.generate
    returns one RequestOutput per prompt: its flat fields are completion 0, and `siblings` holds
    the RequestOutputs of completions 1..n-1 (outputs[j] is completion j)."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] | None = None
    text: str | None = None
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "error"
    abort_reason: str | None = None
    error_code: str | None = None     # finish_reason "error": why, as an OpenAI error code
    adapter: str | None = None
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache at admission
    prompt: str | None = None             # the prompt text, when it was given as text
    stop_reason: int | str | None = None
    lora_request: LoRARequest | None = None
    top_logprobs: list[dict[int, float]] | None = None  # see CompletionOutput
    # SamplingParams.prompt_logprobs=k: per prompt position {token id: logprob} of the k most likely
    # tokens and the prompt token (None at position 0, as vLLM), in top_logprobs' form; prompt_ranks:
    # the prompt token's rank in the vocabulary there (1: the most likely). None when not asked for.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None
    siblings: list[RequestOutput] = dataclasses.field(default_factory=list, repr=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[CompletionOutput]:
        return [r._completion(j) for j, r in enumerate([self, *self.siblings])]

    def _completion(self, index: int) -> CompletionOutput:
        lps = self.logprobs
        return CompletionOutput(index, self.text or "", self.token_ids, float(sum(lps)) if lps is not None else None,
                                lps, self.finish_reason, self.stop_reason, self.top_logprobs)


def new_request_id() -> str:
    return f"req-{next(_ids)}"


def top_dict(top, k: int, token: int, logprob: float) -> dict[int, float]:
    """{token id: logprob} of a step's top row [2, >= k] (ids, logprobs; best first): its first k,
    and the sampled token, as vLLM's logprobs=k."""
    ids, lps = top[0][:k].tolist(), top[1][:k].tolist()
    out = {int(t): lp for t, lp in zip(ids, lps)}
    out.setdefault(token, logprob)
    return out


def stop_ids(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
    ids = set(params.stop_token_ids or ())
    if not params.ignore_eos:
        ids.update(eos_token_ids)
    return frozenset(ids)


@dataclasses.dataclass(eq=False)
class Request:
    rid: str
    tokens: list[int]                 # prompt + generated so far
    prompt_len: int
    params: SamplingParams
    seed: int
    adapter: object | None            # AdapterEntry bound at admission (None: base model)
    out: RequestOutput
    stops: frozenset
    arrival: float
    num_computed: int = 0             # tokens whose K/V are in the pool
    holds_adapter: bool = False       # has a reference on its adapter's pages
    deadline: float | None = None     # arrival + TTFT objective
    first_token_at: float | None = None
    resumed: bool = False             # preempted after admission: goes first
    # prefix caching: the chained keys of its full pages, under the adapter version page_keys_for,
    # and how many of its leading pages were offered to the cache
    page_keys: list = dataclasses.field(default_factory=list, repr=False)
    page_keys_for: object = None
    pages_cached: int = 0
    adapter_name: str | None = dataclasses.field(init=False)  # what the request asked for

    def __post_init__(self):
        self.adapter_name = self.out.adapter if self.out.adapter is not None else \
            self.adapter.name if self.adapter is not None else None

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclasses.dataclass
class Plan:
    """One step: `chunks` are (request, start, end) token ranges; all prefill or all decode."""
    kind: str                                   # "prefill" | "decode" | "idle"
    chunks: list[tuple[Request, int, int]]
    loads: list[tuple[object, list[int]]]       # (adapter entry, pages) to fill before the step
    finished: list[RequestOutput]               # aborted while scheduling
    # Overlapped steps (`advance`): (results row, request, token index) of each PENDING token.
    pending: list[tuple[int, "Request", int]] = dataclasses.field(default_factory=list)

    @property
    def requests(self) -> list[Request]:
        return [c[0] for c in self.chunks]
