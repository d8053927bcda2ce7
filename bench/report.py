"""The metrics of a served trace (bench/run.py's JSON `metrics`) and the table it prints."""

from __future__ import annotations

import numpy as np

from bench.serving import Record


def summarize(recs: list[Record], slo_s: float, wall_s: float) -> dict:
    done = [r for r in recs if r.finish_reason in ("length", "stop")]
    aborted = [r for r in recs if r.finish_reason in ("abort", "rejected")]
    ttfts = np.array([r.ttft for r in recs if r.ttft is not None and r.finish_reason not in ("abort", "rejected")])
    lat = np.array([r.latency for r in done])
    hits = sum(1 for r in recs if r.ttft is not None and r.ttft <= slo_s
               and r.finish_reason not in ("abort", "rejected"))
    gen = sum(r.tokens for r in recs)
    gaps = np.array([g for r in done for g in r.token_gaps])

    def pct(a, q):
        return float(np.percentile(a, q)) if len(a) else None

    return {
        "num_requests": len(recs), "completed": len(done), "aborted": len(aborted),
        "unfinished": len(recs) - len(done) - len(aborted), "wall_s": wall_s,
        "throughput_req_s": len(done) / wall_s if wall_s > 0 else 0.0,
        "generated_tokens": gen, "gen_tok_s": gen / wall_s if wall_s > 0 else 0.0,
        "avg_latency_s": float(lat.mean()) if len(lat) else None,
        "avg_latency_per_token_s": float(np.mean([r.latency / max(r.tokens, 1) for r in done])) if done else None,
        "ttft_avg_s": float(ttfts.mean()) if len(ttfts) else None,
        "ttft_p50_s": pct(ttfts, 50), "ttft_p90_s": pct(ttfts, 90), "ttft_p99_s": pct(ttfts, 99),
        # inter-token latency: the time between a completed request's tokens (engine replay only)
        "itl_p50_s": pct(gaps, 50), "itl_p99_s": pct(gaps, 99),
        "slo_s": slo_s, "slo_attainment": hits / len(recs) if recs else 0.0,
        **cold_warm_ttft(recs),
    }


def cold_warm_ttft(recs: list[Record]) -> dict:
    """TTFT of adapter requests split by whether their adapter was resident when they arrived
    (warm) or had to be paged in (cold): prefetch exists to bring the cold ones close to warm."""
    out = {}
    for name, want in (("cold", True), ("warm", False)):
        t = np.array([r.ttft for r in recs if r.cold is want and r.ttft is not None
                      and r.finish_reason not in ("abort", "rejected")])
        out[f"ttft_{name}_n"] = int(len(t))
        out[f"ttft_{name}_p50_s"] = float(np.percentile(t, 50)) if len(t) else None
        out[f"ttft_{name}_p99_s"] = float(np.percentile(t, 99)) if len(t) else None
    return out


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def table(result: dict) -> str:
    """A few lines a person reads: setting, then the numbers."""
    w, m, p = result["workload"], result["metrics"], result.get("pool", {})
    head = (f"{w['name']} mode={result['mode']} model={w['model']} n={w['n']} ranks={w['ranks']} "
            f"alpha={w['alpha']} R={w['rate']} cv={w['cv']} requests={m['num_requests']} "
            f"on {result.get('device', '?')}")
    rows = [("throughput req/s", m["throughput_req_s"]), ("generated tok/s", m["gen_tok_s"]),
            ("avg latency s", m["avg_latency_s"]), ("TTFT p50 s", m["ttft_p50_s"]),
            ("TTFT p99 s", m["ttft_p99_s"]), ("inter-token p50 / p99 s", f"{_fmt(m.get('itl_p50_s'))} / "
                                                                       f"{_fmt(m.get('itl_p99_s'))}"),
            (f"SLO attainment (<= {m['slo_s']} s)", m["slo_attainment"]),
            ("completed / aborted / unfinished", f"{m['completed']} / {m['aborted']} / {m['unfinished']}"),
            ("wall s", m["wall_s"])]
    for kind in ("cold", "warm"):
        if m.get(f"ttft_{kind}_n"):
            rows.append((f"TTFT {kind} adapter p50 / p99 s (n)",
                         f"{m[f'ttft_{kind}_p50_s']:.3f} / {m[f'ttft_{kind}_p99_s']:.3f} ({m[f'ttft_{kind}_n']})"))
    if "resident_adapters_max" in p:
        rows += [("resident adapters max / mean", f"{p['resident_adapters_max']} / {p['resident_adapters_mean']:.1f}"),
                 ("pool share of adapters mean / max",
                  f"{p['adapter_pool_share_mean']:.3f} / {p['adapter_pool_share_max']:.3f}"),
                 ("steps / evictions / preempted", f"{p['steps']} / {p['evictions']} / {p['preempted']}"),
                 ("compiles during run (s)", f"{p['compiles']} ({p['compile_s']:.1f})"),
                 ("adapter reads from disk", p.get("adapter_disk_loads", "-"))]
        pc = p.get("prefix_cache")
        if pc and pc["queries"]:
            rows.append(("prefix cache hit rate (prompt tokens)", f"{pc['hit_rate']:.3f} of {pc['queries']}"))
        k = p.get("steps_by_kind")
        if k:
            ms = lambda v: f"{v * 1e3:.1f}" if v is not None else "-"  # noqa: E731
            num = lambda v: f"{v:.1f}" if v is not None else "-"  # noqa: E731
            rows += [("prefill / decode steps (ms each)", f"{k['prefill_steps']} ({ms(k['prefill_step_s_mean'])}) / "
                                                          f"{k['decode_steps']} ({ms(k['decode_step_s_mean'])})"),
                     ("sequences / adapters a step", f"{num(k['seqs_per_step_mean'])} / {num(k['adapters_per_step_mean'])}"),
                     ("sequences / adapters a decode step",
                      f"{num(k.get('decode_seqs_per_step_mean'))} / {num(k.get('decode_adapters_per_step_mean'))}"),
                     ("prompt tokens / rows over pooled context a prefill step",
                      f"{num(k.get('prefill_tokens_per_step_mean'))} / {num(k.get('prefill_context_rows_per_step_mean'))}"),
                     ("prefill steps that paged an adapter in first (ms each)",
                      f"{k.get('prefill_steps_with_loads', '-')} ({ms(k.get('prefill_step_with_loads_s_mean'))})"),
                     ("prefetch hits / misses", f"{k['prefetch_hits']} / {k['prefetch_misses']}")]
        ph = p.get("step_seconds")
        if ph and p.get("steps"):
            # "dispatch" is the jitted calls' own time, which on a GPU may include waiting for the
            # device (a limit on computations in flight); "wait" holds the prefetch, which runs
            # while the device computes; before (schedule, loads, inputs) and after (completion)
            # are host work while the device idles.
            each = lambda *names: f"{sum(ph.get(n, 0.0) for n in names) * 1e3 / p['steps']:.1f}"  # noqa: E731
            rows.append(("before / dispatch / wait / after ms a step",
                         f"{each('schedule', 'adapter_loads', 'inputs')} / {each('dispatch')} / "
                         f"{each('prefetch', 'device_wait')} / {each('complete')}"))
        st = p.get("serving_trace")
        if st:
            rows.append((f"traced steps ({st['steps']}): device / busy / span / wall ms, kernels a step",
                         f"{st['device_us_per_step'] / 1e3:.1f} / {st['busy_us_per_step'] / 1e3:.1f} / "
                         f"{st['span_us_per_step'] / 1e3:.1f} / {st['wall_us_per_step'] / 1e3:.1f}, "
                         f"{st['kernels_per_step']:.0f}"))
            idle = st.get("idle_by_host_phase_us") or {}
            if idle:
                rows.append(("traced device idle by host phase, ms a step",
                             ", ".join(f"{k} {v / 1e3:.2f}" for k, v in idle.items())))
            streams = st.get("by_stream") or {}
            if len(streams) > 1:  # work off the compute stream (adapter rows' host->device copies)
                rows.append(("traced device tracks, ms a step (busiest name)",
                             ", ".join(f"{tid}: {v['us_per_step'] / 1e3:.2f} ({v['top'][0]['name'][:24]})"
                                       for tid, v in streams.items())))
    width = max(len(k) for k, _ in rows)
    return "\n".join([head, *(f"  {k:<{width}}  {_fmt(v)}" for k, v in rows)])
