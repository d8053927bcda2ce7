"""In-process engine metrics: plain counters, gauges and histograms (no exporter dependency).

The server exports `EngineMetrics.snapshot()`; `Engine.stats()` flattens it next to the pool's own
numbers. Histograms keep Prometheus-style cumulative buckets, so an exporter maps them one to one.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import math
import time

# Seconds: 1 ms .. 60 s, roughly x2.5 apart (step times, adapter loads, time to first token).
TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TOKEN_BUCKETS = tuple(2**k for k in range(4, 15))  # 16 .. 16384 tokens


@dataclasses.dataclass
class Counter:
    help: str
    value: float = 0

    def inc(self, n: float = 1) -> None:
        self.value += n


@dataclasses.dataclass
class Gauge:
    help: str
    value: float = 0

    def set(self, v: float) -> None:
        self.value = v


@dataclasses.dataclass
class Histogram:
    help: str
    buckets: tuple = TIME_BUCKETS      # upper bounds; a final +inf bucket is implied
    counts: list = None                # per bucket (not cumulative), len(buckets) + 1
    sum: float = 0.0
    count: int = 0

    def __post_init__(self):
        if self.counts is None:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else 0.0

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding the q-quantile (inf past the last bucket, 0 if empty)."""
        if not self.count:
            return 0.0
        rank, seen = q * self.count, 0
        for bound, n in zip((*self.buckets, math.inf), self.counts):
            seen += n
            if seen >= rank:
                return bound
        return math.inf

    def cumulative(self) -> list[tuple[float, int]]:
        """(le, cumulative count) pairs, the exposition format's buckets."""
        out, seen = [], 0
        for bound, n in zip((*self.buckets, math.inf), self.counts):
            seen += n
            out.append((bound, seen))
        return out


class EngineMetrics:
    """Every metric the engine keeps, by name. Gauges are refreshed by the engine after each step."""

    def __init__(self):
        # queue and batch
        self.queue_length = Gauge("requests waiting for admission")
        self.running = Gauge("requests in the running batch")
        self.batch_size = Histogram("sequences per step", COUNT_BUCKETS)
        self.batch_adapters = Histogram("distinct adapters per step", COUNT_BUCKETS)
        self.decode_batch_size = Histogram("sequences per decode step", COUNT_BUCKETS)
        self.decode_batch_adapters = Histogram("distinct adapters per decode step", COUNT_BUCKETS)
        self.prefill_step_seconds = Histogram("prefill step time (dispatch to results)")
        self.decode_step_seconds = Histogram("decode step time (dispatch to results)")
        self.prefill_load_step_seconds = Histogram(
            "prefill step time (dispatch to results) of the prefill steps that paged an adapter in first")
        self.prefill_tokens = Histogram("prompt tokens a prefill step computes", TOKEN_BUCKETS)
        self.prefill_context_rows = Histogram(
            "sequences of a prefill step that start after context in the pool (a cache hit or an earlier chunk)",
            COUNT_BUCKETS)
        # pool
        self.resident_adapters = Gauge("adapter versions with pages in the pool")
        self.adapter_pages = Gauge("pool pages holding adapter weights")
        self.kv_pages = Gauge("pool pages holding KV cache")
        self.free_pages = Gauge("free pool pages")
        self.adapter_page_share = Gauge("adapter pages / (adapter + KV pages)")
        self.evictions = Gauge("idle adapters evicted from the pool (cumulative)")
        self.prefix_cache_queries = Counter("prompt tokens looked up in the prefix cache at admission")
        self.prefix_cache_hits = Counter("prompt tokens served from the prefix cache")
        self.prefix_cached_pages_base = Gauge("pages in the prefix cache holding base-model KV (in use or idle)")
        self.prefix_cached_pages_lora = Gauge("pages in the prefix cache holding an adapter's KV (in use or idle)")
        # adapter loads and prefetch
        self.adapter_load_seconds = Histogram("host time to stage and dispatch one adapter's rows")
        self.adapter_loads = Counter("adapter versions written into the pool (any path)")
        self.prefetch_issued = Counter("adapters copied in ahead of their batch")
        self.prefetch_hits = Counter("admissions whose adapter a prefetch had brought in")
        self.prefetch_misses = Counter("admissions that loaded their adapter on the critical path")
        self.prefetch_dropped = Counter("prefetched adapters released unused (or gone stale)")
        # requests
        self.requests_added = Counter("requests accepted")
        self.requests_finished = Counter("requests finished (any reason)")
        self.requests_aborted = Counter("requests finished with reason 'abort'")
        self.requests_early_aborted = Counter("aborts because the TTFT objective could not be met")
        self.requests_preempted = Counter("preemptions (pages given back, recomputed later)")
        self.tokens_generated = Counter("tokens sampled")
        self.ttft_seconds = Histogram("time to first token")
        self.ttft_slo_met = Counter("first tokens within their TTFT objective")
        self.ttft_slo_missed = Counter("requests with an objective that missed it (aborts included)")

    def items(self):
        return ((k, v) for k, v in vars(self).items() if isinstance(v, (Counter, Gauge, Histogram)))

    def snapshot(self) -> dict:
        """Flat scalars: counters and gauges by name; histograms as _count, _sum, _mean, _p50, _p99."""
        out = {}
        for name, m in self.items():
            if isinstance(m, Histogram):
                out.update({f"{name}_count": m.count, f"{name}_sum": m.sum, f"{name}_mean": m.mean,
                            f"{name}_p50": m.quantile(0.5), f"{name}_p99": m.quantile(0.99)})
            else:
                out[name] = m.value
        return out


class StepCostModel:
    """Step durations as a line in the step's token count, fitted to the observed steps with
    exponential forgetting (one fit per step kind). Early abort asks it how long a prefill step
    takes; a mock can pass an exact model instead."""

    def __init__(self, decay: float = 0.9):
        self.decay = decay
        self._sums: dict[str, list[float]] = {}  # kind -> [n, x, y, xx, xy]

    def observe(self, kind: str, tokens: int, seqs: int, seconds: float) -> None:
        s = self._sums.setdefault(kind, [0.0] * 5)
        for i, v in enumerate((1.0, tokens, seconds, tokens * tokens, tokens * seconds)):
            s[i] = self.decay * s[i] + v

    def predict(self, kind: str, tokens: int) -> float:
        """Expected seconds of a `kind` step over `tokens` tokens (0 while nothing is known)."""
        s = self._sums.get(kind)
        if s is None:
            return 0.0
        n, x, y, xx, xy = s
        mx, my = x / n, y / n
        var = xx / n - mx * mx
        slope = max(0.0, (xy / n - mx * my) / var) if var > 1e-9 * max(1.0, mx * mx) else 0.0
        return max(0.0, my + slope * (tokens - mx))

    def prefill_seconds(self, tokens: int) -> float:
        return self.predict("prefill", tokens)


class PhaseTimer:
    """Host seconds of the step loop by phase, summed (`seconds`), and the last of each (`last`).
    Each phase is also named in device traces (jax.profiler) as `slora.<name>`, so a trace shows
    what the host did while the device waited; without an active trace that costs about a
    microsecond."""

    def __init__(self, phases: tuple[str, ...] = ()):
        self.seconds: dict[str, float] = dict.fromkeys(phases, 0.0)
        self.last: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        import jax  # the scheduler imports this module and stays free of JAX
        t = time.perf_counter()
        with jax.profiler.TraceAnnotation(f"slora.{name}"):
            yield
        self.last[name] = dt = time.perf_counter() - t
        self.seconds[name] = self.seconds.get(name, 0.0) + dt
