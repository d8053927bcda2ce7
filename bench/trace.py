"""S-LoRA's synthetic workload: which adapter, how long, and when.

Draws follow S-LoRA's benchmarks/trace.py (`generate_requests`) in the same order from the same
legacy generator (`numpy.random.RandomState(seed)`), so a given seed gives S-LoRA's own trace:

- adapter id = int(n * power(alpha)): alpha < 1 skews traffic towards low ids, alpha = 1 is
  uniform;
- prompt and output lengths uniform over [lo, hi) each (numpy `randint`; default [8, 512));
- inter-arrival times gamma with shape 1/cv^2 and scale cv^2/R (mean 1/R; cv = 1 is Poisson);
- every request runs to its output length (ignore_eos).

Adapter i has rank ranks[i % len(ranks)], cycling as S-LoRA's launch_server.py registers its
LoRA directories. Numpy and the standard library only: the torch baselines import this too.

A multi-tenant trace (a workload with `system_prompt_range`, `generate_multi_tenant`) repeats
prefixes, as tenants do: adapter i has a fixed system prompt of a length drawn from
system_prompt_range; a request's prompt is its adapter's system prompt and a user turn of
input_range tokens; popularity is Zipf, its exponent solved so that `zipf_top_share` of the
requests go to the top 10% of adapters; with probability `continue_share` a request continues
its adapter's latest conversation: its prompt is that request's prompt, an answer of that
request's output length (fixed tokens of the trace, not the model's answer, so that every run
sends the same prompts) and a new user turn. A continuation that would pass `max_context`
tokens starts a new conversation instead.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from pathlib import Path

import numpy as np

WORKLOAD_DIR = Path(__file__).resolve().parent.parent / "configs" / "workloads"


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    arrival_s: float   # seconds after the start of the trace
    adapter_id: int    # in [0, n)
    prompt_len: int
    output_len: int
    parent: int = -1   # multi-tenant traces: the request whose conversation this continues (-1: new)


@dataclasses.dataclass(frozen=True)
class Workload:
    """One benchmark setting (a configs/workloads/*.toml file, possibly with overrides)."""

    name: str = "custom"
    model: str = "llama-7b"            # a shape name from configs/models (dummy weights)
    dtype: str = "bfloat16"
    ranks: tuple[int, ...] = (8,)
    n: int = 1                         # number of adapters
    alpha: float = 1.0                 # power-law popularity
    rate: float = 1.0                  # R, offered requests per second
    cv: float = 1.0                    # coefficient of variation of the inter-arrival times
    duration_s: float | None = 60.0    # trace length; num_requests = int(rate * duration_s) ...
    num_requests: int | None = None    # ... unless given
    input_range: tuple[int, int] = (8, 512)
    output_range: tuple[int, int] = (8, 512)
    slo_s: float = 6.0                 # first-token deadline
    seed: int = 42
    distinct_files: int = 8            # PEFT directories per rank, registered under n names
    warmup_s: float = 0.0              # seconds of a warm-up trace (another seed) before measuring
    early_abort: bool = False          # pass slo_s to the engine as SamplingParams.ttft_slo
    # multi-tenant traces (see the module doc); None: S-LoRA's trace
    system_prompt_range: tuple[int, int] | None = None
    zipf_top_share: float = 0.6        # share of requests on the top 10% of adapters
    continue_share: float = 0.0        # share of requests that continue an earlier conversation
    max_context: int = 4096            # prompt + output tokens a continuation may reach
    engine: tuple = ()                 # sorted (key, value) EngineConfig fields for LLM(**options)
    sweep: tuple = ()                  # sorted (key, values) for the GPU suite

    @property
    def longest_context(self) -> int:
        """Prompt + output tokens a request of this trace may reach: what warm-up compiles for."""
        if self.system_prompt_range is not None:
            return self.max_context
        return self.input_range[1] + self.output_range[1]

    def __post_init__(self):
        for f in ("ranks", "input_range", "output_range", "system_prompt_range"):
            if getattr(self, f) is not None:
                object.__setattr__(self, f, tuple(int(x) for x in getattr(self, f)))
        for f in ("engine", "sweep"):
            v = getattr(self, f)
            if isinstance(v, dict):
                object.__setattr__(self, f, tuple(sorted((k, tuple(x) if isinstance(x, list) else x)
                                                         for k, x in v.items())))
        if self.n < 1 or not self.ranks or min(self.ranks) < 1:
            raise ValueError(f"{self.name}: need n >= 1 and positive ranks, got n={self.n}, ranks={self.ranks}")
        if self.alpha <= 0 or self.rate <= 0 or self.cv <= 0:
            raise ValueError(f"{self.name}: alpha, rate and cv must be > 0")
        if self.system_prompt_range is not None:
            if not 0.0 < self.zipf_top_share < 1.0 or not 0.0 <= self.continue_share < 1.0:
                raise ValueError(f"{self.name}: zipf_top_share must be in (0, 1) and continue_share in [0, 1)")
            if self.max_context < self.system_prompt_range[1] + self.input_range[1] + self.output_range[1]:
                raise ValueError(f"{self.name}: max_context must hold the longest fresh conversation")
        for f in ("input_range", "output_range") + (("system_prompt_range",) if self.system_prompt_range else ()):
            lo, hi = getattr(self, f)
            if not 1 <= lo < hi:
                raise ValueError(f"{self.name}: {f} must be [lo, hi) with 1 <= lo < hi, got {(lo, hi)}")
        if self.num_requests is None and self.duration_s is None:
            raise ValueError(f"{self.name}: give duration_s or num_requests")

    @property
    def total_requests(self) -> int:
        return int(self.num_requests) if self.num_requests is not None else int(self.rate * self.duration_s)

    @property
    def engine_options(self) -> dict:
        return dict(self.engine)

    @property
    def sweeps(self) -> dict:
        return dict(self.sweep)

    def rank_of(self, adapter_id: int) -> int:
        return self.ranks[adapter_id % len(self.ranks)]

    def replace(self, **overrides) -> "Workload":
        overrides = {k: v for k, v in overrides.items() if v is not None}
        if "num_requests" in overrides:
            overrides.setdefault("duration_s", None)
        elif "duration_s" in overrides:
            overrides["num_requests"] = None
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["engine"], d["sweep"] = self.engine_options, self.sweeps
        for f in ("ranks", "input_range", "output_range", "system_prompt_range"):
            d[f] = list(d[f]) if d[f] is not None else None
        return d


def load_workload(name_or_path: str | Path, **overrides) -> Workload:
    """`S1`, `S2-cpu`, ... from configs/workloads, or a path to a TOML file."""
    path = Path(name_or_path)
    if not path.is_file():
        path = WORKLOAD_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in WORKLOAD_DIR.glob("*.toml")))
        raise ValueError(f"unknown workload {str(name_or_path)!r}; known: {known}")
    d = tomllib.loads(path.read_text())
    fields = {f.name for f in dataclasses.fields(Workload)}
    unknown = set(d) - fields
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
    d.setdefault("name", path.stem)
    return Workload(**d).replace(**overrides)


@dataclasses.dataclass(frozen=True)
class Trace:
    workload: Workload
    requests: tuple[TraceRequest, ...]

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self):
        return iter(self.requests)

    @property
    def span_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    def adapter_counts(self) -> np.ndarray:
        return np.bincount([r.adapter_id for r in self.requests], minlength=self.workload.n)

    def stats(self) -> dict:
        if not self.requests:
            return {"num_requests": 0}
        arr = np.array([r.arrival_s for r in self.requests])
        gaps = np.diff(np.concatenate([[0.0], arr]))
        counts = self.adapter_counts()
        return {
            "num_requests": len(self.requests), "span_s": float(arr[-1]),
            "offered_rate": len(arr) / float(arr[-1]) if arr[-1] > 0 else math.inf,
            "mean_gap_s": float(gaps.mean()), "gap_cv": float(gaps.std() / gaps.mean()),
            "distinct_adapters": int((counts > 0).sum()),
            "prompt_tokens": int(sum(r.prompt_len for r in self.requests)),
            "output_tokens": int(sum(r.output_len for r in self.requests)),
            "continued": sum(r.parent >= 0 for r in self.requests),
            # requests on the 10% of adapters with the lowest ids (the most popular by construction)
            "top10_share": float(counts[:max(1, len(counts) // 10)].sum() / len(self.requests)),
        }

    def prompts(self, vocab_size: int) -> list[list[int]]:
        """Every request's prompt ids: random ones (`prompt_tokens`), or in a multi-tenant trace
        the system prompt, the conversation so far and the user turn."""
        w = self.workload
        if w.system_prompt_range is None:
            return [prompt_tokens(i, r.prompt_len, vocab_size, w.seed) for i, r in enumerate(self.requests)]
        systems = system_prompt_lengths(w)
        out: list[list[int]] = []
        for i, r in enumerate(self.requests):
            if r.parent < 0:
                head = random_ids([w.seed, 1, r.adapter_id], int(systems[r.adapter_id]), vocab_size)
            else:  # the conversation so far: its prompt and a fixed answer of its output length
                p = self.requests[r.parent]
                head = out[r.parent] + random_ids([w.seed, 2, r.parent], p.output_len, vocab_size)
            out.append(head + prompt_tokens(i, r.prompt_len - len(head), vocab_size, w.seed))
        return out


def generate(w: Workload, seed: int | None = None) -> Trace:
    """The trace of workload `w` (seed: w.seed unless given). Same seed, same trace."""
    if w.system_prompt_range is not None:
        return generate_multi_tenant(w, seed)
    rs = np.random.RandomState(w.seed if seed is None else seed)
    total = w.total_requests
    ids = (rs.power(w.alpha, total) * w.n).astype(int)
    prompt = rs.randint(w.input_range[0], w.input_range[1], total)
    output = rs.randint(w.output_range[0], w.output_range[1], total)
    gaps = rs.gamma(1.0 / (w.cv * w.cv), w.cv * w.cv / w.rate, total)
    arrival = np.cumsum(gaps)
    reqs = tuple(TraceRequest(float(t), int(a), int(p), int(o))
                 for t, a, p, o in zip(arrival, np.minimum(ids, w.n - 1), prompt, output))
    return Trace(w, reqs)


def zipf_exponent(n: int, top_share: float) -> float:
    """The exponent s of popularity 1/(i+1)^s over n adapters that puts `top_share` of the
    requests on the top 10% of them (bisection; the share grows with s)."""
    ranks = np.arange(1, n + 1, dtype=np.float64)
    top = max(1, n // 10)
    lo, hi = 0.0, 8.0
    for _ in range(60):
        s = (lo + hi) / 2
        w = ranks ** -s
        lo, hi = (s, hi) if w[:top].sum() / w.sum() < top_share else (lo, s)
    return (lo + hi) / 2


def system_prompt_lengths(w: Workload) -> np.ndarray:
    """Each adapter's system prompt length (fixed by the workload's seed, whatever the trace's)."""
    lo, hi = w.system_prompt_range
    return np.random.RandomState(w.seed).randint(lo, hi, w.n)


def generate_multi_tenant(w: Workload, seed: int | None = None) -> Trace:
    """A multi-tenant trace (see the module doc): system prompts, Zipf popularity, continued
    conversations. prompt_len is the whole prompt's length."""
    rs = np.random.RandomState(w.seed if seed is None else seed)
    total = w.total_requests
    p = np.arange(1, w.n + 1, dtype=np.float64) ** -zipf_exponent(w.n, w.zipf_top_share)
    ids = rs.choice(w.n, total, p=p / p.sum())
    turn = rs.randint(w.input_range[0], w.input_range[1], total)
    output = rs.randint(w.output_range[0], w.output_range[1], total)
    arrival = np.cumsum(rs.gamma(1.0 / (w.cv * w.cv), w.cv * w.cv / w.rate, total))
    goes_on = rs.random_sample(total) < w.continue_share
    anyone = rs.random_sample(total)  # a continuation whose adapter has no conversation to continue
    systems = system_prompt_lengths(w)
    reqs: list[TraceRequest] = []
    by_adapter: dict[int, list[int]] = {}

    def fits(j: int, i: int) -> bool:
        q = reqs[j]
        return q.prompt_len + q.output_len + int(turn[i]) + int(output[i]) <= w.max_context

    for i in range(total):
        a, parent = int(ids[i]), -1
        if goes_on[i] and i > 0:
            # the adapter's latest conversation that has room, else an earlier request's (any
            # adapter's, from a random point back), so that continue_share of them continue
            parent = next((j for j in reversed(by_adapter.get(a, ())) if fits(j, i)), -1)
            if parent < 0:
                parent = next((j for j in range(int(anyone[i] * i), -1, -1) if fits(j, i)), -1)
                a = reqs[parent].adapter_id if parent >= 0 else a
        if parent >= 0:
            length = reqs[parent].prompt_len + reqs[parent].output_len + int(turn[i])
        else:
            length = int(systems[a]) + int(turn[i])
        reqs.append(TraceRequest(float(arrival[i]), a, length, int(output[i]), parent))
        by_adapter.setdefault(a, []).append(i)
    return Trace(w, tuple(reqs))


def prompt_tokens(req_index: int, length: int, vocab_size: int, seed: int) -> list[int]:
    """Deterministic random prompt ids in [3, vocab) for request `req_index` of a trace."""
    return random_ids([seed, req_index], length, vocab_size)


def random_ids(entropy: list[int], length: int, vocab_size: int) -> list[int]:
    """`length` token ids in [3, vocab), fixed by `entropy` (non-negative ints)."""
    return np.random.default_rng(entropy).integers(3, vocab_size, length).tolist()


@dataclasses.dataclass(frozen=True)
class FixedBatch:
    """The HF PEFT comparison: B requests at once, one prompt length, one output length, the
    requests spread over `mixed` adapters round-robin (mixed = 0: base model)."""

    batch: int = 32
    prompt_len: int = 128
    output_len: int = 128
    mixed: int = 32
    rank: int = 16
    seed: int = 0

    def prompts(self, vocab_size: int) -> list[list[int]]:
        return [prompt_tokens(i, self.prompt_len, vocab_size, self.seed) for i in range(self.batch)]

    def adapter_ids(self) -> list[int | None]:
        return [i % self.mixed if self.mixed else None for i in range(self.batch)]
