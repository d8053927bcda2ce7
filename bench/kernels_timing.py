"""bench/kernels.py's timing: a variant's K input sets in one jit, its wall clock and (traced) device
time a call, and its check against the reference."""

from __future__ import annotations

import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench.device_trace import busy_span, traced

TOL = 2e-2                   # max |variant - xla reference| / max |reference|, bf16


def _err(msg: BaseException) -> str:
    text = f"{type(msg).__name__}: {msg}"
    return text if len(text) < 600 else text[:600] + " ..."


def run_variant(fn, shared, sets, *, iters: int, warmup: int, iter_s: float, device_time: bool = False):
    """Compile fn over all K sets (one jit, K calls unrolled), run it once for the outputs, then
    time it. Returns (result dict, outputs [K]). device_time: also trace one more round of the
    timed calls and report the device's own time per call ("device": kernels' busy time, their
    sum, their count, and the traced span), which leaves out what the wall clock adds: host
    dispatch and launch gaps."""
    many = jax.jit(lambda sh, ss: [fn(sh, s) for s in ss])
    t0 = time.perf_counter()
    outs = jax.block_until_ready(many(shared, sets))
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        jax.block_until_ready(many(shared, sets))
    t0 = time.perf_counter()
    jax.block_until_ready(many(shared, sets))
    one = time.perf_counter() - t0
    reps = max(1, min(64, int(iter_s / max(one, 1e-9))))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(reps):
            res = many(shared, sets)
        jax.block_until_ready(res)
        ts.append((time.perf_counter() - t0) / (reps * len(sets)))
    del res
    out = {"us": float(np.median(ts)) * 1e6, "us_min": float(np.min(ts)) * 1e6, "reps": reps,
           "sets": len(sets), "iters": iters, "compile_and_first_s": compile_s}
    if device_time:
        with traced() as events:
            for _ in range(reps):
                res = many(shared, sets)
            jax.block_until_ready(res)
        del res
        calls = reps * len(sets)
        busy, span = busy_span(events)
        by_name: dict[str, float] = {}
        for e in events:
            by_name[e.get("name", "?")] = by_name.get(e.get("name", "?"), 0.0) + float(e.get("dur", 0.0)) / calls
        out["device"] = {"busy_us": busy / calls, "kernel_us": sum(float(e.get("dur", 0.0)) for e in events) / calls,
                         "kernels": len(events) / calls, "span_us": span / calls,
                         "by_kernel_us": dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:6])}
    return out, outs


@jax.jit
def _rel_err(got, want):
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-30)


def rel_err(outs, refs) -> float:
    return max(float(_rel_err(o, r)) for o, r in zip(outs, refs))


def _add_fracs(res: dict, nbytes: int, bw: float) -> dict:
    """res["frac_copy"]: nbytes over the timed wall clock, as a share of copy bandwidth bw; the
    same over the device's busy time where it was traced (res["device"]["frac_copy"])."""
    res["frac_copy"] = nbytes / (res["us"] * 1e-6) / bw
    if res.get("device", {}).get("busy_us"):
        res["device"]["frac_copy"] = nbytes / (res["device"]["busy_us"] * 1e-6) / bw
    return res


def measure(variants: dict, ref_name: str, shared_of, sets_of, bytes_: int, bw: float,
            opts) -> dict:
    """Time every variant (the reference first); check each against the reference's outputs."""
    results, refs = {}, None
    for name in [ref_name] + [v for v in variants if v != ref_name]:
        fn = variants[name]
        if fn is None:
            results[name] = None
            continue
        try:
            res, outs = run_variant(fn, shared_of(name), sets_of(name), iters=opts["iters"],
                                    warmup=opts["warmup"], iter_s=opts["iter_s"],
                                    device_time=opts.get("device_time", False))
            if name == ref_name:
                refs, res["rel_err"] = outs, 0.0
            else:
                res["rel_err"] = rel_err(outs, refs) if refs is not None else None
                del outs
            res["ok"] = res["rel_err"] is not None and res["rel_err"] < TOL
            res["GBps"] = bytes_ / (res["us"] * 1e-6) / 1e9
            _add_fracs(res, bytes_, bw)
        except Exception as e:  # noqa: BLE001: one variant failing must not lose the others
            traceback.print_exc(limit=3)
            res = {"error": _err(e), "ok": False}
        results[name] = res
    return results


# ---------------------------------------------------------------------------------------------
# LoRA: the pool, the adapters in it, the input sets.
