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
    engine: tuple = ()                 # sorted (key, value) EngineConfig fields for LLM(**options)
    sweep: tuple = ()                  # sorted (key, values) for the GPU suite

    def __post_init__(self):
        for f in ("ranks", "input_range", "output_range"):
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
        for f in ("input_range", "output_range"):
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
        for f in ("ranks", "input_range", "output_range"):
            d[f] = list(d[f])
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
        }


def generate(w: Workload, seed: int | None = None) -> Trace:
    """The trace of workload `w` (seed: w.seed unless given). Same seed, same trace."""
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


def prompt_tokens(req_index: int, length: int, vocab_size: int, seed: int) -> list[int]:
    """Deterministic random prompt ids in [3, vocab) for request `req_index` of a trace."""
    rng = np.random.default_rng([seed, req_index])
    return rng.integers(3, vocab_size, length).tolist()


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
