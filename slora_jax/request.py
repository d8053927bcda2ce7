"""What a request carries in (`Request`: its tokens, adapter and progress, the scheduler's unit),
what one step runs (`Plan`), and what comes back out (`RequestOutput`)."""

from __future__ import annotations

import dataclasses
import itertools

from slora_jax.sampling import SamplingParams

_ids = itertools.count()


@dataclasses.dataclass
class RequestOutput:
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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def new_request_id() -> str:
    return f"req-{next(_ids)}"


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
