"""What a request carries in and what comes back out."""

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
    finish_reason: str | None = None  # "length" | "stop" | "abort"
    abort_reason: str | None = None
    adapter: str | None = None

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
