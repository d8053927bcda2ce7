"""The benchmark harness: S-LoRA's trace generator, bench/run.py end to end on the S1-cpu
miniature, its HTTP client against a stand-in server, the plots, and the HF PEFT baseline's
code path (--smoke, in the oracle interpreter when there is one).

The end-to-end run compiles a dozen small step shapes on a CPU (~20-30 s cold, a few seconds
with the persistent compilation cache); the rest is fast.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import http_client, plots, report, run, serving  # noqa: E402
from pallas_kernels import lora as lora_kernels  # noqa: E402
from slora_jax.engine.scheduler import MAX_PREFILL_SEQS  # noqa: E402
from bench.trace import (FixedBatch, Workload, generate, load_workload,  # noqa: E402
                         WORKLOAD_DIR)

# -- the trace ---------------------------------------------------------------------------------


@pytest.mark.parametrize("cv", [1.0, 4.0])
def test_arrivals_have_the_requested_rate_and_cv(cv):
    w = Workload(n=100, rate=8.0, cv=cv, num_requests=200_000, duration_s=None)
    s = generate(w).stats()
    assert s["num_requests"] == 200_000
    assert s["mean_gap_s"] == pytest.approx(1 / 8.0, rel=0.03)
    assert s["gap_cv"] == pytest.approx(cv, rel=0.05)
    assert s["offered_rate"] == pytest.approx(8.0, rel=0.03)


def test_lengths_are_uniform_in_the_configured_half_open_ranges():
    w = Workload(num_requests=50_000, duration_s=None, input_range=(8, 512), output_range=(3, 7))
    t = generate(w)
    p = np.array([r.prompt_len for r in t])
    o = np.array([r.output_len for r in t])
    assert p.min() == 8 and p.max() == 511 and p.mean() == pytest.approx((8 + 511) / 2, rel=0.01)
    assert set(o.tolist()) == {3, 4, 5, 6}


@pytest.mark.parametrize("alpha", [0.1, 0.5])
def test_adapter_popularity_is_a_monotone_power_law(alpha):
    n = 5
    w = Workload(n=n, alpha=alpha, num_requests=100_000, duration_s=None)
    counts = generate(w).adapter_counts()
    assert (np.diff(counts) < 0).all(), counts  # alpha < 1: low ids are the popular ones
    expected = np.diff((np.arange(n + 1) / n) ** alpha)  # P(id = k) = ((k+1)/n)^a - (k/n)^a
    np.testing.assert_allclose(counts / counts.sum(), expected, atol=0.01)


def test_alpha_one_is_uniform_and_ids_stay_in_range():
    w = Workload(n=7, alpha=1.0, num_requests=70_000, duration_s=None)
    counts = generate(w).adapter_counts()
    assert len(counts) == 7 and counts.sum() == 70_000
    np.testing.assert_allclose(counts / 70_000, 1 / 7, atol=0.01)


def test_trace_is_deterministic_per_seed_and_is_s_loras():
    w = Workload(n=50, alpha=0.6, rate=3.0, cv=2.0, duration_s=100.0)
    a, b, c = generate(w), generate(w), generate(w, seed=w.seed + 1)
    assert a.requests == b.requests
    assert a.requests != c.requests
    # S-LoRA's benchmarks/trace.py: the global legacy generator, drawn in this order.
    np.random.seed(w.seed)
    total = int(w.rate * w.duration_s)
    ids = (np.random.power(w.alpha, total) * w.n).astype(int)
    ins = np.random.randint(*w.input_range, total)
    outs = np.random.randint(*w.output_range, total)
    tic = np.cumsum(np.random.gamma(1 / w.cv ** 2, w.cv ** 2 / w.rate, total))
    assert [r.adapter_id for r in a] == ids.tolist()
    assert [r.prompt_len for r in a] == ins.tolist()
    assert [r.output_len for r in a] == outs.tolist()
    np.testing.assert_allclose([r.arrival_s for r in a], tic)


def test_workload_files_and_rank_assignment():
    names = sorted(p.stem for p in WORKLOAD_DIR.glob("*.toml"))
    for s in ("S1", "S2", "S4"):
        assert s in names and f"{s}-cpu" in names
    ranks = {"S1": (8,), "S2": (64, 32, 16, 8), "S4": (64, 32, 16)}
    for name, rk in ranks.items():
        w = load_workload(name)
        assert w.ranks == rk and w.slo_s == 6.0
        assert [w.rank_of(i) for i in range(2 * len(rk))] == list(rk) * 2  # cycling, as S-LoRA
        assert w.engine_options["max_lora_rank"] == max(rk)
        cpu = load_workload(f"{name}-cpu")
        assert cpu.model == "tiny" and cpu.total_requests <= 16
    assert load_workload("S4").model == "llama-2-13b"
    w = load_workload("S1", n=5, rate=20.0, num_requests=30)
    assert (w.n, w.rate, w.total_requests, w.duration_s) == (5, 20.0, 30, None)
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload("S9")


def test_fixed_batch_requests_are_shared_and_deterministic():
    fb = FixedBatch(batch=8, prompt_len=5, output_len=3, mixed=3)
    assert fb.prompts(100) == fb.prompts(100)
    assert all(len(p) == 5 and min(p) >= 3 for p in fb.prompts(100))
    assert fb.adapter_ids() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert dataclasses.replace(fb, mixed=0).adapter_ids() == [None] * 8


# -- metrics -----------------------------------------------------------------------------------


def test_summarize_counts_aborts_and_cutoffs_as_slo_misses():
    R = serving.Record
    recs = [R(0, 0.0, "a", 4, 2, first_token_s=1.0, finish_s=2.0, tokens=2, finish_reason="length"),
            R(1, 1.0, "a", 4, 2, first_token_s=8.0, finish_s=9.0, tokens=2, finish_reason="length"),
            R(2, 2.0, None, 4, 2, finish_s=3.0, finish_reason="abort"),
            R(3, 3.0, None, 4, 2, finish_s=3.0, finish_reason="rejected"),
            R(4, 4.0, "b", 4, 2, first_token_s=5.0, tokens=1, finish_reason="cutoff")]
    m = report.summarize(recs, slo_s=6.0, wall_s=10.0)
    assert (m["completed"], m["aborted"], m["unfinished"]) == (2, 2, 1)
    assert m["slo_attainment"] == pytest.approx(2 / 5)  # requests 0 and 4 met the deadline
    assert m["throughput_req_s"] == pytest.approx(0.2)
    assert m["generated_tokens"] == 5 and m["gen_tok_s"] == pytest.approx(0.5)
    assert m["avg_latency_s"] == pytest.approx(5.0)
    assert m["ttft_p50_s"] == pytest.approx(1.0)


def test_padded_and_separate_modes_select_a_baseline():
    from slora_jax.config import AdapterMemoryBaseline
    w = load_workload("S1-cpu")
    assert run.engine_options(w, "padded", baseline_size=4)["baseline"] == AdapterMemoryBaseline("padded_slots", 4)
    assert run.engine_options(w, "padded")["baseline"] == AdapterMemoryBaseline("padded_slots", 8)
    opts = run.engine_options(w, "separate", baseline_size=8)
    assert opts["baseline"] == AdapterMemoryBaseline("separate", 8)
    assert run.options_json(opts)["baseline"] == {"kind": "separate", "size": 8}
    with pytest.raises(ValueError, match="needs --baseline-size"):
        run.engine_options(w, "separate")
    assert run.engine_options(w, "base") == w.engine_options
    assert run.engine_options(w, "unified") == w.engine_options
    with pytest.raises(ValueError, match="mode must be"):
        run.engine_options(w, "vllm")


# -- end to end --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s1_cpu(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "s1-cpu.json"
    # with a device trace of 4 serving steps from the start (pool.serving_trace)
    result = run.main(["--workload", "S1-cpu", "--out", str(out), "--trace-steps", "4", "--trace-after-s", "0"])
    return result, out


def test_run_py_on_the_s1_cpu_miniature(s1_cpu):
    result, out = s1_cpu
    saved = json.loads(out.read_text())
    assert saved["metrics"] == result["metrics"]
    for key in ("commit", "device", "platform", "command", "workload", "trace", "pool", "engine_options"):
        assert key in saved, key
    assert saved["lora_block_sizes"]["shrink"]["split_k"] == lora_kernels.ShrinkBlockSizes.get_default().split_k
    assert saved["baseline"] is None  # the engine's own unified pool, not a baseline
    m, p = result["metrics"], result["pool"]
    w = load_workload("S1-cpu")
    assert m["num_requests"] == w.total_requests == len(result["requests"])
    assert m["completed"] + m["aborted"] == m["num_requests"] and m["unfinished"] == 0
    assert 0.0 <= m["slo_attainment"] <= 1.0
    assert m["gen_tok_s"] > 0 and m["throughput_req_s"] > 0
    assert m["ttft_p50_s"] <= m["ttft_p99_s"]
    assert 1 <= p["resident_adapters_max"] <= w.n
    assert 0.0 < p["adapter_pool_share_max"] <= 1.0
    k, ph = p["steps_by_kind"], p["step_seconds"]  # what the run's time was made of
    assert k["prefill_steps"] + k["decode_steps"] <= p["steps"] and k["decode_steps"] > 0
    assert 1.0 <= k["seqs_per_step_mean"] and 0.0 < k["adapters_per_step_mean"] <= k["seqs_per_step_mean"]
    # decode steps alone: at least as many rows as the average step (prefill steps pack few prompts)
    assert k["seqs_per_step_mean"] <= k["decode_seqs_per_step_mean"]
    assert 0.0 < k["decode_adapters_per_step_mean"] <= k["decode_seqs_per_step_mean"]
    # S1's 2000-odd adapters: some prefill steps page one in first (their copy on the step's path)
    assert 0 < k["prefill_steps_with_loads"] <= k["prefill_steps"] and k["prefill_step_with_loads_s_mean"] > 0
    assert 1 <= k["prefill_tokens_per_step_mean"] <= w.engine_options["max_num_batched_tokens"]
    assert 0 <= k["prefill_context_rows_per_step_mean"] <= MAX_PREFILL_SEQS
    assert ph["device_wait"] > 0 and ph["inputs"] > 0 and all(v >= 0 for v in ph.values())
    assert sum(ph.values()) <= p["wall_s"]
    st = p["serving_trace"]  # 4 traced steps, summed by kernel on the CPU client's XLA threads
    assert st["steps"] == 4 and st["kernels_per_step"] > 0 and st["device_us_per_step"] > 0
    assert 0 < st["busy_us_per_step"] <= st["span_us_per_step"] and st["wall_us_per_step"] > 0
    assert st["steps_by_kind"]["prefill_steps"] + st["steps_by_kind"]["decode_steps"] <= 4
    assert sum(v["us_per_step"] for v in st["by_stream"].values()) == pytest.approx(st["device_us_per_step"])
    # the CPU loop is not overlapped: between steps the device waits on the engine's host phases,
    # which the trace names (engine._phase)
    idle = st["idle_by_host_phase_us"]
    assert all(v >= 0 for v in idle.values())
    assert sum(idle.get(k, 0.0) for k in ("schedule", "adapter_loads", "inputs", "complete")) > 0, idle
    for r in result["requests"]:
        if r["finish_reason"] == "length":  # ignore_eos: every request runs to its length
            assert r["tokens"] == r["output_len"]
            assert r["arrival_s"] <= r["first_token_s"] <= r["finish_s"]
            # one gap a token after the first, and they span first token to finish
            assert len(r["token_gaps"]) == r["tokens"] - 1
            assert sum(r["token_gaps"]) == pytest.approx(r["finish_s"] - r["first_token_s"], abs=1e-6)
    assert 0 < m["itl_p50_s"] <= m["itl_p99_s"]
    assert "throughput req/s" in run.table(result) and "inter-token" in run.table(result)


@pytest.mark.parametrize("mode, flags, reserved", [
    ("separate", ["--baseline-size", "12"], 12),  # same step shapes as the unified run
    ("padded", ["--baseline-size", "2"], 18),               # 2 slots of 9 pages (rank 8, every module)
])
def test_run_py_memory_baselines(s1_cpu, mode, flags, reserved):
    result = run.main(["--workload", "S1-cpu", "--mode", mode, "--no-requests", *flags])
    m, p = result["metrics"], result["pool"]
    kind = {"padded": "padded_slots"}.get(mode, mode)
    assert result["baseline"] == result["engine_options"]["baseline"] == {"kind": kind, "size": int(flags[1])}
    assert m["completed"] == m["num_requests"] and m["unfinished"] == 0
    assert result["pool_at_start"]["adapter_pages"] == reserved
    if mode == "padded":
        assert p["resident_adapters_max"] <= 2


def test_run_py_variants_share_one_model_and_resume(tmp_path):
    """Several traces on one loaded model: each variant's JSON, the second on a fresh engine with
    the first's pool size and no compile during its run, a rate taken from the first's req/s, a
    failing variant that leaves a .failed beside the others, and a second call that skips what is
    done."""
    args = ["--workload", "S1-cpu", "--duration-s", "2", "--warmup-s", "0", "--no-requests",
            "--out-dir", str(tmp_path), "--variant", "uni:", "--variant", "base:--mode base",
            "--variant", "half:--rate-from uni:0.5", "--variant", "bad:--engine page_size=0"]
    run.main(args)
    uni, base, half = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("uni", "base", "half"))
    assert "page_size must be a positive integer" in (tmp_path / "bad.failed").read_text()
    assert base["mode"] == "base" and base["shared_process"] and not uni["shared_process"]
    assert base["pool_at_start"]["total_pages"] == uni["pool_at_start"]["total_pages"]
    assert base["pool"]["resident_adapters_max"] == 0 < uni["pool"]["resident_adapters_max"]
    assert half["workload"]["rate"] == round(0.5 * uni["metrics"]["throughput_req_s"], 2)
    assert uni["warmup_shapes"] > 0
    for r in (base, half):  # the first variant's warm-up compiled every step bucket
        assert r["pool"]["compiles"] == 0, r["variant"]
        assert r["metrics"]["completed"] == r["metrics"]["num_requests"]
    mtime = (tmp_path / "uni.json").stat().st_mtime
    run.main(args[:-2])  # all done: nothing runs again
    assert (tmp_path / "uni.json").stat().st_mtime == mtime


def test_plots_from_run_jsons(s1_cpu, tmp_path):
    result, out = s1_cpu
    base = json.loads(out.read_text())
    for n, rate, thr in ((1, 20.0, 0.5), (3, 10.0, 0.4)):  # made-up neighbours: an n sweep, a rate sweep
        d = json.loads(json.dumps(base))
        d["workload"]["n"], d["workload"]["rate"], d["metrics"]["throughput_req_s"] = n, rate, thr
        (tmp_path / f"n{n}.json").write_text(json.dumps(d))
    d = json.loads(json.dumps(base))
    d["mode"] = "base"
    (tmp_path / "base.json").write_text(json.dumps(d))
    d["workload"]["rate"], d["metrics"]["throughput_req_s"] = 99.0, 7.0  # a base run no sweep matches
    (tmp_path / "base-other-rate.json").write_text(json.dumps(d))
    (tmp_path / "s1.json").write_text(out.read_text())
    runs = plots.load([str(tmp_path)])
    # the base model is drawn beside the n sweep at its own rate, and only there
    refs = plots.references(runs, plots.sweeps(runs, "n"), "n", "throughput_req_s")
    assert [v for _, v in refs] == [base["metrics"]["throughput_req_s"]], refs
    assert plots.references(runs, plots.sweeps(runs, "rate"), "rate", "slo_attainment") == []
    assert plots.references(runs, plots.sweeps(runs, "alpha"), "alpha", "throughput_req_s") == []  # no alpha sweep
    d = json.loads(json.dumps(base))
    d["workload"]["alpha"], d["metrics"]["throughput_req_s"] = 0.1, 0.6  # an alpha sweep beside s1.json
    (tmp_path / "alpha0.1.json").write_text(json.dumps(d))
    runs = plots.load([str(tmp_path)])
    refs = plots.references(runs, plots.sweeps(runs, "alpha"), "alpha", "throughput_req_s")
    assert [v for _, v in refs] == [base["metrics"]["throughput_req_s"]], refs
    written = {p.name for p in plots.main([str(tmp_path)])}
    assert {"throughput_vs_n.png", "throughput_vs_alpha.png", "slo_vs_rate.png", "ttft_cdf_S1-cpu.png",
            "summary.md"} <= written
    text = (tmp_path / "summary.md").read_text()
    assert "S1-cpu" in text and "| S1-cpu | 3 |" in text  # the unified/base ratio row


# -- HTTP --------------------------------------------------------------------------------------


class _FakeOpenAI(http.server.BaseHTTPRequestHandler):
    """Streams max_tokens one-token chunks, then usage, as an OpenAI completions server does."""
    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]
        for k in range(n):
            choice = {"index": 0, "text": "x", "finish_reason": "length" if k == n - 1 else None}
            self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

    def log_message(self, *args):
        pass


def test_http_client_against_a_stand_in_server():
    pytest.importorskip("httpx")
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        w = load_workload("S1-cpu", rate=50.0)
        trace = generate(w)
        names = [serving.adapter_name(i) for i in range(w.n)]
        recs, wall = asyncio.run(http_client._http_replay(f"http://127.0.0.1:{srv.server_port}", trace, names, None, 512))
    finally:
        srv.shutdown()
    assert len(_FakeOpenAI.seen) == len(trace)
    assert all(b["stream"] and b["ignore_eos"] and b["temperature"] == 0.0 for b in _FakeOpenAI.seen)
    assert {b["model"] for b in _FakeOpenAI.seen} <= set(names)
    for rec in recs:
        assert rec.finish_reason == "length" and rec.tokens == rec.output_len
        assert rec.arrival_s <= rec.first_token_s <= rec.finish_s
    m = report.summarize(recs, w.slo_s, wall)
    assert m["completed"] == len(trace) and m["slo_attainment"] == 1.0


def _server_exists() -> bool:
    import importlib.util
    return all(importlib.util.find_spec(m) is not None for m in ("slora_jax.serve.app", "fastapi", "uvicorn", "httpx"))


@pytest.fixture
def server_url(tmp_path):
    """SLORA_BENCH_SERVER_URL, or with SLORA_BENCH_HTTP=1 a `slora-jax serve` of the tiny model
    spawned here with S1-cpu's engine options (its step shapes hit the compilation cache)."""
    if os.environ.get("SLORA_BENCH_SERVER_URL"):
        yield os.environ["SLORA_BENCH_SERVER_URL"], None
        return
    if os.environ.get("SLORA_BENCH_HTTP") != "1" or not _server_exists():
        pytest.skip("needs SLORA_BENCH_SERVER_URL, or SLORA_BENCH_HTTP=1 and slora_jax.serve.app (~15 s more)")
    e = load_workload("S1-cpu").engine_options
    cmd = [sys.executable, "-m", "slora_jax", "serve", "--model", "tiny", "--dtype", "float32", "--port", "0",
           "--warmup", "off", "--served-model-name", "tiny", "--allowed-adapter-dirs", str(tmp_path),
           "--max-lora-rank", str(e["max_lora_rank"]), "--max-num-seqs", str(e["max_num_seqs"]),
           "--pool-pages", str(e["pool_pages"]), "--max-num-batched-tokens", str(e["max_num_batched_tokens"]),
           "--max-loras", str(e["max_loras"]), "--page-size", str(e["page_size"])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        url = None
        for line in proc.stdout:  # "slora-jax: serving tiny + 0 adapters on http://127.0.0.1:PORT (...)"
            if "serving" in line and "http://" in line:
                url = line.split("http://")[1].split()[0]
                break
        assert url, "the server exited before it was serving"
        yield "http://" + url, tmp_path
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_http_against_a_real_server(server_url, tmp_path):
    url, adapter_dir = server_url
    result = run.main(["--workload", "S1-cpu", "--http", url, "--http-register",
                       "--adapter-dir", str(adapter_dir or tmp_path), "--out", str(tmp_path / "http.json")])
    m = result["metrics"]
    assert m["completed"] + m["aborted"] == m["num_requests"] and m["gen_tok_s"] > 0
    for r in result["requests"]:
        if r["finish_reason"] == "length":
            assert r["tokens"] == r["output_len"]


# -- the HF PEFT baseline -----------------------------------------------------------------------


def _torch_python() -> str | None:
    py = os.environ.get("SLORA_ORACLE_PYTHON")
    for cand in ([py, str(REPO / py)] if py else []) + [str(REPO / ".venv-oracle" / "bin" / "python")]:
        if cand and Path(cand).exists():
            return cand
    return None


@pytest.mark.skipif(_torch_python() is None, reason="no python with torch+transformers+peft "
                                                    "(SLORA_ORACLE_PYTHON or .venv-oracle)")
def test_hf_peft_baseline_smoke(tmp_path):
    out = tmp_path / "hf.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="2", HF_HUB_OFFLINE="1")
    p = subprocess.run([_torch_python(), str(REPO / "bench" / "baselines" / "hf_peft.py"), "--smoke",
                        "--part", "all", "--out", str(out)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    d = json.loads(out.read_text())
    assert [r["what"] for r in d["mixed"]] == ["base", "single", "mixed-1", "mixed-4"]
    assert [r["what"] for r in d["merged"]] == ["merged-1", "merged-4"]
    for r in d["mixed"] + d["merged"]:
        assert r["generated_tokens"] == r["batch"] * r["gen_len"] and r["gen_tok_s"] > 0
    assert d["merged"][1]["batches"] == 4
    assert all(r["merged_matches_unmerged"] for r in d["merged"])
    assert d["complete"] is True


@pytest.mark.skipif(_torch_python() is None, reason="no python with torch+transformers+peft "
                                                    "(SLORA_ORACLE_PYTHON or .venv-oracle)")
def test_hf_peft_keeps_finished_rows_when_cut_short(tmp_path):
    """A run stopped by its timeout (SIGINT, as gpu_suite sends) inside the merged part leaves a
    JSON with the rows it finished, marked incomplete: a GPU call's measurements survive it."""
    out = tmp_path / "hf.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="2", HF_HUB_OFFLINE="1")
    p = subprocess.Popen([_torch_python(), str(REPO / "bench" / "baselines" / "hf_peft.py"), "--smoke",
                          "--part", "all", "--merged-mixed", "1," + ",".join(["4"] * 20000), "--out", str(out)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # until the first merged row is saved
            if out.exists() and json.loads(out.read_text()).get("merged"):  # written by rename: whole
                break
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        p.wait(timeout=60)
    finally:
        p.kill()
    d = json.loads(out.read_text())
    assert d["complete"] is False
    assert [r["what"] for r in d["mixed"]] == ["base", "single", "mixed-1", "mixed-4"]
    assert d["merged"] and d["merged"][0]["what"] == "merged-1" and len(d["merged"]) < 20001




def test_idle_by_phase_splits_each_gap_among_the_host_phases():
    from tools.profile_step import idle_by_phase
    dev = [{"ts": 0, "dur": 10}, {"ts": 5, "dur": 15}, {"ts": 100, "dur": 10}, {"ts": 115, "dur": 5},
           {"ts": 300, "dur": 10}]
    host = [{"ts": 20, "dur": 40, "name": "slora.schedule"}, {"ts": 60, "dur": 30, "name": "slora.inputs"},
            {"ts": 150, "dur": 400, "name": "slora.device_wait"}]
    got = idle_by_phase(dev, host, steps=2)
    # gap 20-100: schedule 40, inputs 30, 10 of no phase; gap 110-115 is short; gap 120-300: 30
    # of no phase before device_wait's 150 in it
    assert got == {"device_wait": 75.0, "no phase": 20.0, "schedule": 20.0, "inputs": 15.0, "short gaps": 2.5}


def test_summary_by_stream_separates_device_tracks():
    """profile_step.summarize's by_stream: events a step and time a step per device track (a
    trace's thread id: a GPU stream), busiest track first, each with its busiest names."""
    from tools.profile_step import summarize
    ev = [{"tid": 7, "name": "fusion_1", "ts": 0, "dur": 10}, {"tid": 7, "name": "gemm", "ts": 10, "dur": 30},
          {"tid": 7, "name": "fusion_1", "ts": 40, "dur": 10}, {"tid": 9, "name": "MemcpyHtoD", "ts": 5, "dur": 16}]
    got = summarize(ev, steps=2, top=5)["by_stream"]
    assert list(got) == ["7", "9"]
    assert got["7"]["per_step"] == 1.5 and got["7"]["us_per_step"] == 25.0
    assert [t["name"] for t in got["7"]["top"]] == ["gemm", "fusion_1"]
    assert got["9"] == {"per_step": 0.5, "us_per_step": 8.0,
                        "top": [{"name": "MemcpyHtoD", "per_step": 0.5, "us_per_step": 8.0}]}


def test_prefill_batch_is_the_engines_prefill_step(tmp_path):
    """bench/engine_bench.prefill_batch (profile_step --prefill): its one packed prefill step,
    run as the profile runs it, samples each prompt's first token as LLM.generate does."""
    import jax
    from bench.engine_bench import prefill_batch
    from slora_jax import LLM, SamplingParams
    from slora_jax.engine import step as paged
    from slora_jax.model.peft import random_peft_adapter

    llm = LLM("tiny", max_num_seqs=8, max_lora_rank=16)
    for i, r in enumerate((8, 16)):
        llm.load_adapter(f"a{i}", random_peft_adapter(tmp_path / f"a{i}", llm.cfg, rank=r, seed=i, std=0.05,
                                                      targets=["q_proj", "v_proj", "o_proj"]))
    reqs, inp = prefill_batch(llm, 5, 24, ["a0", "a1", None])
    eng = llm.engine
    try:
        eng.kv, res = paged.step(llm.params, eng.kv, inp, cfg=llm.cfg)
        got = np.asarray(jax.device_get(res))[:len(reqs), 0].astype(int).tolist()
    finally:
        for r in reqs:
            eng._release(r)
    assert sorted(r.adapter_name or "" for r in reqs) == ["", "a0", "a0", "a1", "a1"]  # prompt i on adapter i mod 3
    outs = llm.generate([r.tokens for r in reqs], SamplingParams(max_tokens=1, temperature=0.0),
                        adapter=[r.adapter_name for r in reqs])
    assert got == [o.token_ids[0] for o in outs]


def test_kernels_py_quick_with_device_time(tmp_path):
    """bench/kernels.py's CPU smoke run: every variant checked against the reference, with
    --device-time the traced kernel time a call beside the wall clock, and with --read-floor the
    rows' gather alone (bench/read_floor.py)."""
    out = tmp_path / "k.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, str(REPO / "bench" / "kernels.py"), "--quick", "--skip", "attention",
                        "--modules", "qkvo", "--tokens", "8", "--adapters", "2", "--device-time", "--read-floor",
                        "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    d = json.loads(out.read_text())
    (case,) = d["lora"]
    assert all(case["variants"][v]["ok"] for v in ("pallas", "onehot", "padded")), case["variants"]
    dev = case["variants"]["pallas"]["device"]
    assert dev["kernels"] > 0 and 0 < dev["busy_us"] <= dev["span_us"] + 1e-6
    # --read-floor: the case's live rows (2 slots of ranks 4 and 8 on W = 32, fin = 64: 8 + 16 A^T
    # rows padded to 32, as many B rows) gathered in one launch and in two, each checked against
    # bench/read_floor.read_reference, and the two launches again with a trip more (a tile table)
    floor = case["read_floor"]
    assert floor["rows"] == [32, 32]
    for form in ("one_launch", "two_launches", "two_launches_hop"):
        assert floor[form]["ok"] and floor[form]["us"] > 0 and floor[form]["best"] in floor[form]["tilings"]
    assert dev["by_kernel_us"] and 0 < sum(dev["by_kernel_us"].values()) <= dev["kernel_us"] + 1e-6
    assert "qkvo" in d["targets"][0]["device"] and d["targets"][0]["measure"] == "device"


def test_kernels_py_prints_device_time_without_the_pallas_variant(tmp_path):
    """A run of other variants alone still prints their device time, not only in its JSON."""
    out = tmp_path / "k.json"
    p = subprocess.run([sys.executable, str(REPO / "bench" / "kernels.py"), "--quick", "--skip", "attention",
                        "--modules", "qkvo", "--tokens", "8", "--adapters", "2", "--lora-variants", "onehot",
                        "--device-time", "--out", str(out)],
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    (case,) = json.loads(out.read_text())["lora"]
    assert case["variants"]["pallas"] is None and case["variants"]["onehot"]["ok"]
    busy = case["variants"]["xla_ref"]["device"]["busy_us"]
    line = next(ln for ln in p.stdout.splitlines() if "device time a call:" in ln)
    assert f"xla-ref {busy:.1f} us busy" in line, line


def test_kernels_py_quick_bf16_y(tmp_path):
    """bench/kernels.py --y-dtype bfloat16 (the engine's form: the expand adds into a bf16 y):
    every variant's bf16 output checked against the reference's, y's bytes at 2 a value."""
    out = {}
    for yd in ("float32", "bfloat16"):
        out[yd] = tmp_path / f"k-{yd}.json"
        p = subprocess.run([sys.executable, str(REPO / "bench" / "kernels.py"), "--quick", "--skip", "attention",
                            "--modules", "qkvo", "--tokens", "8", "--adapters", "2", "--y-dtype", yd,
                            "--lora-variants", "pallas,padded", "--out", str(out[yd])],
                           env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    (f32,), (b16,) = (json.loads(out[yd].read_text())["lora"] for yd in ("float32", "bfloat16"))
    assert (f32["y_dtype"], b16["y_dtype"]) == ("float32", "bfloat16")
    assert b16["bytes"]["y"] * 2 == f32["bytes"]["y"] and b16["bytes"]["adapters"] == f32["bytes"]["adapters"]
    assert all(b16["variants"][v]["ok"] for v in ("pallas", "padded")), b16["variants"]




@pytest.mark.parametrize("page_rows", [0, 8])
def test_kernel_pool_places_adapter_rows_apart(page_rows):
    """bench/kernels.py's LoraPool: no two adapters (or an adapter's A and B) share a pool row;
    with page_rows, each adapter's rows fill whole pages of consecutive rows, as the engine places
    them, and pages are not shared."""
    from bench.kernels import QUICK, LoraPool
    pool = LoraPool("qkvo", 64, 64, {**QUICK, "page_rows": page_rows}, seed=3)
    used = []
    for m, r in enumerate(pool.ranks):
        na, nb = -(-int(r) * 64 // pool.width), -(-int(r) * 64 // pool.width)
        rows = np.concatenate([pool.a_idx[m, :na], pool.b_idx[m, :nb]])
        used.append(rows)
        if page_rows:
            pages = np.unique(rows // page_rows)
            assert len(pages) == -(-len(rows) // page_rows)  # as few pages as the rows need
            for p in pages:  # within a page, the adapter's rows are consecutive from its start
                in_page = np.sort(rows[rows // page_rows == p])
                np.testing.assert_array_equal(in_page, p * page_rows + np.arange(len(in_page)))
    flat = np.concatenate(used)
    assert len(np.unique(flat)) == len(flat)
    assert flat.max() < pool.n_rows
    if page_rows:
        owner = {}
        for m, rows in enumerate(used):
            for p in set((rows // page_rows).tolist()):
                assert owner.setdefault(p, m) == m


@pytest.mark.parametrize("col_tile,splits", [(32, 1), (64, 2), (16, 4)])
def test_read_floor_kernel_matches_reference(col_tile, splits):
    """bench/read_floor.paged_read (interpret mode): each row's sum over each split's columns, the
    rows at random pool positions, equals read_reference, also with a tile order read first;
    live_rows takes each slot's first
    ceil(r * f / W) index entries and pads to whole tiles with the first row."""
    import jax
    import jax.numpy as jnp

    from bench.read_floor import TILE_ROWS, live_rows, paged_read, read_reference
    rows = jax.random.normal(jax.random.PRNGKey(col_tile), (300, 256), jnp.bfloat16)
    idx = jnp.asarray(np.random.default_rng(splits).permutation(300)[:3 * TILE_ROWS], jnp.int32)
    got = paged_read(rows, idx, col_tile=col_tile, splits=splits, interpret=True)
    want = read_reference(rows, idx, splits=splits)
    assert got.shape == (3, splits * TILE_ROWS) and float(jnp.abs(want).max()) > 0
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
    order = jnp.asarray([2, 0, 1], jnp.int32)  # program p reads index tile order[p] first
    got = paged_read(rows, idx, order, col_tile=col_tile, splits=splits, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(read_reference(rows, idx, order, splits=splits)),
                               rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(got)[0], np.asarray(want)[2], rtol=1e-5, atol=1e-4)
    a_rows, b_rows = np.arange(40).reshape(2, 20), 100 + np.arange(40).reshape(2, 20)
    a, b = live_rows(a_rows, b_rows, np.array([3, 0]), fin=512, fout=256, width=256)
    assert a.tolist() == [0, 1, 2, 3, 4, 5] + [0] * 10 and b.tolist() == [100, 101, 102] + [100] * 13


def test_git_commit_marks_a_tree_that_differs_from_head(tmp_path, monkeypatch):
    from bench import provenance
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True, text=True)
    git("init", "-q")
    (tmp_path / "f.py").write_text("a = 1\n")
    git("add", "f.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = git("rev-parse", "HEAD").stdout.strip()
    monkeypatch.delenv("SLORA_COMMIT", raising=False)
    monkeypatch.setattr(provenance, "REPO", tmp_path)
    (tmp_path / "untracked.txt").write_text("not part of any result\n")
    assert provenance.git_commit() == head
    (tmp_path / "f.py").write_text("a = 2\n")
    assert provenance.git_commit() == head + "-dirty"


def test_step_hlo_lowers_the_plain_decode_step_with_the_triton_kernel():
    """bench/step_hlo.py lowers for the GPU on this CPU: the decode kernel appears as one Triton call
    (the kernel itself, not its CPU interpreter), and the text is deterministic."""
    from bench import step_hlo
    from slora_jax.model.config import load_model_config
    import pallas_kernels.paged_attention as decode_kernel
    cfg = load_model_config("tiny")
    saved = decode_kernel._interpret
    decode_kernel._interpret = lambda interpret: False
    try:
        texts = [step_hlo.step_hlo(cfg, 4, 4, 8, decode=True) for _ in range(2)]
    finally:
        decode_kernel._interpret = saved
    assert texts[0] == texts[1] and texts[0].count("xla.gpu.triton") == 1
