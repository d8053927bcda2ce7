"""Device time from a JAX profiler trace: the kernels a traced region ran on the device, and
how much of the region's span they kept it busy (tools/profile_step.py, bench/kernels.py,
bench/run.py's traced steps)."""

from __future__ import annotations

import contextlib
import glob
import gzip
import json
import os
import shutil
import tempfile

import jax


@contextlib.contextmanager
def traced():
    """Trace the block with jax.profiler; yields a list that holds the device's kernel events
    (device_events) once the block has ended."""
    trace_dir = tempfile.mkdtemp(prefix="slora-trace-")
    events: list[dict] = []
    try:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            yield events
        events.extend(device_events(trace_dir))
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)


def trace_events(trace_dir: str) -> list[dict]:
    path = sorted(glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "perfetto_trace.json.gz")))[-1]
    data = json.load(gzip.open(path))
    return data["traceEvents"] if isinstance(data, dict) else data


def device_events(trace_dir: str) -> list[dict]:
    """Complete events ('X') of the device's tracks: GPU streams, or the CPU client's XLA threads."""
    events = trace_events(trace_dir)
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    # Device tracks with events; a GPU build's profiler may name an empty GPU track in a CPU run
    # (JAX_PLATFORMS=cpu on the GPU machine), and then the CPU client's threads are the device.
    busy = {e["pid"] for e in events if e.get("ph") == "X"}
    gpu = [pid for pid, n in procs.items() if ("gpu" in n.lower() or "device" in n.lower()) and pid in busy]

    def on_device(e) -> bool:
        if gpu:
            return e["pid"] in gpu
        return "XLA" in threads.get((e["pid"], e.get("tid")), "") and "Client" not in \
            threads.get((e["pid"], e.get("tid")), "")
    return [e for e in events if e.get("ph") == "X" and on_device(e)]


def busy_span(events: list[dict]) -> tuple[float, float]:
    """(union of the events' intervals, last end - first start), in microseconds."""
    iv = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events if "ts" in e)
    if not iv:
        return 0.0, 0.0
    busy, (lo, hi) = 0.0, iv[0]
    for a, b in iv[1:]:
        if a > hi:
            busy, lo, hi = busy + hi - lo, a, b
        else:
            hi = max(hi, b)
    busy += hi - lo
    return busy, max(b for _, b in iv) - iv[0][0]
