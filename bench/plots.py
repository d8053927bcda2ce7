"""Plots and a summary table from a folder of bench/run.py and hf_peft.py JSONs.

    python bench/plots.py bench/results/<run>/          # writes PNGs and summary.md there
    python bench/plots.py a.json b.json --out-dir figs/

- throughput_vs_n.png: req/s against the number of adapters, one line per sweep over n
- slo_vs_rate.png: SLO attainment against the offered rate, one line per rate sweep, 0.9 marked
- ttft_cdf_<workload>.png: the CDF of time to first token, one line per run (at most 12)
- summary.md: every trace run in one table; the fixed-batch engine vs HF PEFT ratios
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

SWEPT = ("n", "rate", "alpha", "cv")


def load(paths: list[str]) -> list[dict]:
    files = []
    for p in map(Path, paths):
        files += sorted(p.rglob("*.json")) if p.is_dir() else [p]
    runs = []
    for f in files:
        try:
            d = json.loads(f.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(d, dict) and d.get("kind") in ("trace", "fixed_batch", "hf_peft"):
            d["_file"] = str(f)
            runs.append(d)
    return runs


# Engine options every run of a results folder sets the same way (bench/gpu_suite.sh): left out
# of the labels. Anything else a run changed from its workload's [engine] table names its setup.
_COMMON = {"pool_pages"}


def _setup(run: dict) -> str:
    """Commit, early abort off (the configs turn it on), and the engine options a run changed from
    its workload's: runs that differ in any of these are different systems, never one line."""
    w = run["workload"]
    table = w.get("engine", {})
    opts = [f"{k}={v}" for k, v in sorted(run.get("engine_options", {}).items())
            if k not in _COMMON and table.get(k, object()) != v]
    if not w.get("early_abort", True):
        opts.append("no early abort")
    return " ".join([str(run.get("commit", "?"))[:7], *opts])


def _key(run: dict, free: str) -> tuple:
    w = run["workload"]
    return (w["name"], run["mode"], w["model"], _setup(run), *(w[k] for k in SWEPT if k != free))


def _label(key: tuple, free: str) -> str:
    rest = [k for k in SWEPT if k != free]
    return f"{key[0]} {key[1]} " + " ".join(f"{k}={v}" for k, v in zip(rest, key[4:])) + f" [{key[3]}]"


def sweeps(runs: list[dict], free: str) -> dict[tuple, list[dict]]:
    """Runs that differ only in `free`, grouped; groups of one run are left out."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        if r.get("kind") == "trace" and "metrics" in r:
            groups.setdefault(_key(r, free), []).append(r)
    return {k: sorted(v, key=lambda r: r["workload"][free]) for k, v in groups.items()
            if len({r["workload"][free] for r in v}) > 1}


# Trace parameters that only pick adapters (how many, how skewed): the base model's run serves the
# same requests whatever they are, so one base run stands beside a sweep over either.
ADAPTERS_ONLY = ("n", "alpha")


def references(runs: list[dict], groups: dict[tuple, list[dict]], free: str, metric: str) -> list[tuple]:
    """(label, value) of the base-model runs beside a sweep over n or alpha: the base model has
    neither, so it is one run of the same workload, commit, rate and cv as the swept unified runs."""
    if free not in ADAPTERS_ONLY:
        return []
    kept = [k for k in SWEPT if k not in ADAPTERS_ONLY]

    def key(r: dict) -> tuple:
        w = r["workload"]
        return (w["name"], w["model"], str(r.get("commit"))[:7], *(w[k] for k in kept))
    wanted = {key(r) for rs in groups.values() for r in rs if r["mode"] == "unified"}
    out = []
    for r in runs:
        if r.get("kind") != "trace" or r.get("mode") != "base" or "metrics" not in r:
            continue
        w = r["workload"]
        if key(r) in wanted:
            rest = " ".join(f"{k}={w[k]}" for k in kept)
            out.append((f"{w['name']} base model {rest} [{str(r.get('commit'))[:7]}]", r["metrics"][metric]))
    return out


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _log_x(ax) -> None:
    from matplotlib.ticker import FuncFormatter
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def _device(runs) -> str:
    devs = sorted({r.get("device", "?") for r in runs})
    return ", ".join(devs)


def plot_sweep(runs, free: str, metric: str, ylabel: str, path: Path, logx=False, hline=None) -> bool:
    groups = sweeps(runs, free)
    if not groups:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, rs in groups.items():
        ax.plot([r["workload"][free] for r in rs], [r["metrics"][metric] for r in rs], "o-",
                label=_label(key, free))
    if hline is not None:
        ax.axhline(hline, color="gray", ls="--", lw=1)
    for (label, value), color in zip(references(runs, groups, free, metric), ("k", "gray", "brown", "olive")):
        ax.axhline(value, color=color, ls=":", lw=1.2, label=label)
    if logx:
        _log_x(ax)
    ax.set_xlabel({"n": "adapters (n)", "rate": "offered rate R (req/s)",
                   "alpha": "popularity exponent alpha (adapter int(n * power(alpha)))"}.get(free, free))
    ax.set_ylabel(ylabel)
    ax.set_title(f"{ylabel} vs {free}  ({_device(runs)})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_ttft_cdf(runs, out_dir: Path, max_lines: int = 12) -> list[Path]:
    by_workload: dict[str, list[dict]] = {}
    for r in runs:
        if r.get("kind") == "trace" and r.get("requests"):
            by_workload.setdefault(r["workload"]["name"], []).append(r)
    written = []
    plt = _plt() if by_workload else None
    for name, rs in by_workload.items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        slo = rs[0]["workload"]["slo_s"]
        for r in rs[:max_lines]:
            ttft = np.sort([q["first_token_s"] - q["arrival_s"] for q in r["requests"]
                            if q["first_token_s"] is not None])
            if not len(ttft):
                continue
            w = r["workload"]
            # y counts every request, so the curve tops out at the share that ever got a token
            ax.step(ttft, np.arange(1, len(ttft) + 1) / len(r["requests"]), where="post",
                    label=f"{r['mode']} n={w['n']} R={w['rate']} a={w['alpha']} cv={w['cv']} [{_setup(r)}]")
        ax.axvline(slo, color="gray", ls="--", lw=1)
        _log_x(ax)
        ax.set_xlabel("time to first token (s)")
        ax.set_ylabel("share of requests")
        ax.set_title(f"TTFT CDF, {name}  ({_device(rs)})", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"ttft_cdf_{name}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def _f(v, digits=3) -> str:
    return "-" if v is None else f"{v:.{digits}g}" if isinstance(v, float) else str(v)


def summary(runs: list[dict]) -> str:
    lines = ["| workload | mode | n | R | alpha | cv | req/s | tok/s | avg lat s | TTFT p50 s | TTFT p99 s "
             "| SLO att. | done/abort/cut | resident max | adapter share | compiles | file |",
             "|" + "---|" * 17]
    trace = sorted((r for r in runs if r.get("kind") == "trace" and "metrics" in r),
                   key=lambda r: (r["workload"]["name"], r["mode"], *(r["workload"][k] for k in SWEPT)))
    for r in trace:
        w, m, p = r["workload"], r["metrics"], r.get("pool", {})
        lines.append("| " + " | ".join([
            w["name"], r["mode"], str(w["n"]), _f(w["rate"]), _f(w["alpha"]), _f(w["cv"]),
            _f(m["throughput_req_s"]), _f(m["gen_tok_s"], 4), _f(m["avg_latency_s"]), _f(m["ttft_p50_s"]),
            _f(m["ttft_p99_s"]), _f(m["slo_attainment"]), f"{m['completed']}/{m['aborted']}/{m['unfinished']}",
            _f(p.get("resident_adapters_max")), _f(p.get("adapter_pool_share_mean")),
            _f(p.get("compiles")), Path(r["_file"]).name]) + " |")
    out = [f"Device: {_device(runs)}. Commits: {', '.join(sorted({r.get('commit', '?')[:10] for r in runs}))}.",
           "", "## Trace runs", "", *lines]
    out += ["", "## Base-model ratio (same trace, mode unified vs base)", ""]
    base = {(r["workload"]["name"], *(r["workload"][k] for k in ("rate", "alpha", "cv", "num_requests",
                                                                 "duration_s"))): r
            for r in trace if r["mode"] == "base"}
    ratio_lines = ["| workload | n | R | req/s | base req/s | ratio | tok/s | base tok/s | ratio |", "|" + "---|" * 9]
    for r in trace:
        w = r["workload"]
        b = base.get((w["name"], w["rate"], w["alpha"], w["cv"], w["num_requests"], w["duration_s"]))
        if r["mode"] == "unified" and b:
            m, bm = r["metrics"], b["metrics"]
            ratio_lines.append(f"| {w['name']} | {w['n']} | {_f(w['rate'])} | {_f(m['throughput_req_s'])} | "
                               f"{_f(bm['throughput_req_s'])} | {_f(m['throughput_req_s'] / bm['throughput_req_s'])} | "
                               f"{_f(m['gen_tok_s'], 4)} | {_f(bm['gen_tok_s'], 4)} | "
                               f"{_f(m['gen_tok_s'] / bm['gen_tok_s'])} |")
    out += ratio_lines if len(ratio_lines) > 2 else ["(no unified/base pair)"]
    out += ["", "## Fixed batch: engine vs HF PEFT (generated tok/s, same requests)", ""]
    eng = {row["mixed_adapters"]: row for r in runs if r.get("kind") == "fixed_batch" for row in r["fixed_batch"]}
    hf = {}
    for r in runs:
        if r.get("kind") == "hf_peft":
            for row in r.get("mixed", []) + r.get("merged", []):
                hf[row["what"]] = row
    fl = ["| adapters | engine tok/s | HF PEFT (b) tok/s | engine / HF | merged swap (c) tok/s | engine / merged |",
          "|" + "---|" * 6]
    for k, row in sorted(eng.items()):
        h = hf.get("base" if k == 0 else f"mixed-{k}")
        mg = hf.get(f"merged-{k}")
        fl.append(f"| {k} | {_f(row['gen_tok_s'], 4)} | {_f(h['gen_tok_s'], 4) if h else '-'} | "
                  f"{_f(row['gen_tok_s'] / h['gen_tok_s']) if h else '-'} | "
                  f"{_f(mg['gen_tok_s'], 4) if mg else '-'} | {_f(row['gen_tok_s'] / mg['gen_tok_s']) if mg else '-'} |")
    out += fl if len(fl) > 2 else ["(no fixed-batch runs)"]
    return "\n".join(out) + "\n"


def main(argv=None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("inputs", nargs="+", help="result folders or JSON files")
    ap.add_argument("--out-dir", default=None, help="default: the first input folder")
    args = ap.parse_args(argv)
    runs = load(args.inputs)
    first = Path(args.inputs[0])
    out_dir = Path(args.out_dir) if args.out_dir else (first if first.is_dir() else first.parent)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if plot_sweep(runs, "n", "throughput_req_s", "throughput (req/s)", out_dir / "throughput_vs_n.png", logx=True):
        written.append(out_dir / "throughput_vs_n.png")
    if plot_sweep(runs, "alpha", "throughput_req_s", "throughput (req/s)", out_dir / "throughput_vs_alpha.png"):
        written.append(out_dir / "throughput_vs_alpha.png")
    if plot_sweep(runs, "rate", "slo_attainment", "SLO attainment", out_dir / "slo_vs_rate.png", hline=0.9):
        written.append(out_dir / "slo_vs_rate.png")
    written += plot_ttft_cdf(runs, out_dir)
    (out_dir / "summary.md").write_text(summary(runs))
    written.append(out_dir / "summary.md")
    for p in written:
        print(p)
    return written


if __name__ == "__main__":
    main()
