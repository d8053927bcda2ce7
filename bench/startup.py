"""Start-up time of `slora-jax serve`: from process start until the first request is answered.

    python bench/startup.py --out startup.json -- --model llama-7b --load-format dummy   # GPU
    JAX_PLATFORMS=cpu python bench/startup.py --out /tmp/s.json                         # embedded default

Starts the server as a subprocess on a free port with the arguments after `--`, and records:
  listening_s    process start -> the "serving ... on http://..." line (the port accepts requests)
  first_token_s  process start -> the first completion's response (max_tokens 4, greedy), sent as
                 soon as the port listens, to the base model and then to an adapter when one is
                 registered (`first_adapter_s`)
  all_compiled_s process start -> the server's "every step bucket compiled" line, when it compiles
                 them in the background (`--warmup background`, the default)
With `--runs K` the same command runs K times in a row: the first on the compile cache as found
(empty it with --cache-dir and --fresh-cache), the rest warm.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == REPO / "bench":
    sys.path[0] = str(REPO)

from bench.provenance import git_commit  # noqa: E402

LISTENING = re.compile(r"serving .* on (http://\S+) ")
BACKGROUND = re.compile(r"compiling (\d+) step buckets in the background")
ALL_COMPILED = re.compile(r"every step bucket compiled")


def _first_completion(url: str, model: str, timeout: float) -> float:
    import httpx
    # token ids, not text: a model given by its config name (dummy weights) has no tokenizer
    body = {"model": model, "prompt": [1, 5, 6, 7, 8], "max_tokens": 4, "temperature": 0.0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
    r.raise_for_status()
    return time.perf_counter()


def one_run(serve_args: list[str], timeout: float) -> dict:
    cmd = [sys.executable, "-m", "slora_jax", "serve", "--port", "0", *serve_args]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    marks: dict[str, float] = {}
    url: list[str] = []
    lines: list[str] = []
    listening = threading.Event()

    def read():
        for line in p.stdout:
            lines.append(line.rstrip())
            now = time.perf_counter() - t0
            m = LISTENING.search(line)
            if m and not url:
                url.append(m.group(1))
                marks["listening_s"] = now
                listening.set()
            m = BACKGROUND.search(line)
            if m:
                marks["buckets"] = int(m.group(1))
            if ALL_COMPILED.search(line) and "all_compiled_s" not in marks:
                marks["all_compiled_s"] = now

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not listening.wait(timeout):
            raise RuntimeError(f"no listening line within {timeout} s; output:\n" + "\n".join(lines[-30:]))
        import httpx
        models = [m["id"] for m in httpx.get(url[0] + "/v1/models", timeout=30).json()["data"]]
        marks["first_token_s"] = _first_completion(url[0], models[0], timeout) - t0
        if len(models) > 1:
            marks["first_adapter_s"] = _first_completion(url[0], models[1], timeout) - t0
        if "buckets" in marks:  # compiling in the background: wait for the end
            deadline = time.perf_counter() + timeout
            while "all_compiled_s" not in marks and time.perf_counter() < deadline and p.poll() is None:
                time.sleep(0.2)
    finally:
        p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
        reader.join(5)
    return {**{k: round(v, 2) for k, v in marks.items()}, "log_tail": lines[-8:]}


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, serve_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2, help="the first as the cache is, then warm")
    ap.add_argument("--cache-dir", default=None,
                    help="the server's --compilation-cache-dir (default: the server's own default)")
    ap.add_argument("--fresh-cache", action="store_true", help="empty --cache-dir before the first run")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(ours)
    if args.cache_dir:
        if args.fresh_cache:
            shutil.rmtree(args.cache_dir, ignore_errors=True)
        serve_args = [*serve_args, "--compilation-cache-dir", args.cache_dir]
    # No JAX in this process: on a GPU it would take device memory from the server it measures.
    device = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                            text=True).stdout.strip() if shutil.which("nvidia-smi") else "cpu"
    result = {"commit": git_commit(), "command": " ".join(["python", "bench/startup.py", *argv]),
              "device": device or "cpu", "cpu_count": os.cpu_count(),
              "load_average_at_start": os.getloadavg(),  # other work on the machine slows a CPU start
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    result.update(kind="startup", serve_args=serve_args, runs=[])
    for k in range(args.runs):
        r = one_run(serve_args, args.timeout)
        r["cache"] = "as found" if k == 0 else "warm"
        result["runs"].append(r)
        print(f"run {k} ({r['cache']}): " + ", ".join(f"{n} {v}" for n, v in r.items() if n.endswith("_s")),
              flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
