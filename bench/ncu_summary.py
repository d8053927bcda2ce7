"""Read back `gpu_check.sh ncu`'s CSVs (Nsight Compute's details page, one file a LoRA kernel
setting): per setting, case and kernel, the median time and DRAM throughput, occupancy and
registers; `--best` prints the setting whose expand is fastest on one case (for a script to pick).

    python bench/ncu_summary.py DIR --cases 64x32,256x256              # the table
    python bench/ncu_summary.py DIR --cases 64x32,256x256 --best 256x256 # index of the best setting
    python bench/ncu_summary.py FILE.csv                                   # launch by launch (ncustep)

bench/ncu_lora.py runs each case reps + 1 times (the last call checks the output), each call a
shrink and an expand, in the order of --cases: launch i belongs to case i // (2 * (reps + 1)).
"""

from __future__ import annotations

import argparse
import csv
import glob
import gzip
import json
import os
import re
import statistics


def _num(v: str) -> float:
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return float("nan")


def read(path: str) -> list[dict]:
    """One dict a profiled launch, in launch order: name, grid and its metrics by name."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        rows = [r for r in csv.reader(f) if len(r) > 10]
    if not rows:
        return []
    col = {h: i for i, h in enumerate(rows[0])}
    launches: dict[str, dict] = {}
    for r in rows[1:]:
        def get(k):
            return r[col[k]] if col[k] < len(r) else ""
        d = launches.setdefault(get("ID"), {"name": get("Kernel Name"), "grid": get("Grid Size"), "m": {}})
        d["m"][get("Metric Name")] = get("Metric Value")
    return [launches[k] for k in sorted(launches, key=int)]


def summarize(launches: list[dict], cases: list[str], reps: int) -> dict:
    """{case: {kernel: {us, dram_pct, occupancy_pct, registers, grid, launches}}}, medians."""
    per_case = 2 * (reps + 1)
    out: dict = {}
    for i, ln in enumerate(launches):
        case = cases[i // per_case] if i // per_case < len(cases) else f"launch{i}"
        kind = "shrink" if "shrink" in ln["name"] else "expand" if "expand" in ln["name"] else ln["name"]
        out.setdefault(case, {}).setdefault(kind, []).append(ln)
    res: dict = {}
    for case, kinds in out.items():
        for kind, lns in kinds.items():
            def med(metric):
                return statistics.median(_num(x["m"].get(metric, "nan")) for x in lns)
            res.setdefault(case, {})[kind] = {
                "us": med("gpu__time_duration.sum") / 1e3, "dram_pct": med("DRAM Throughput"),
                "occupancy_pct": med("Achieved Occupancy"), "registers": med("Registers Per Thread"),
                "dram_read_MB": med("dram__bytes_read.sum") / 1e6, "grid": lns[0]["grid"], "launches": len(lns)}
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--cases", default="64x32,256x256")
    ap.add_argument("--reps", type=int, default=2, help="ncu_lora.py --reps")
    ap.add_argument("--best", default=None, help="a case: print the index of the setting with the fastest expand")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    cases = args.cases.split(",")
    if os.path.isfile(args.dir):  # one CSV (gpu_check.sh ncustep): every launch in order
        for i, ln in enumerate(read(args.dir)):
            m = ln["m"]
            us = _num(m.get("gpu__time_duration.sum", "nan")) / 1e3
            mb = _num(m.get("dram__bytes_read.sum", "nan")) / 1e6
            print(f"{i:3d} {ln['name'][:28]:28s} grid {ln['grid']:14s} {us:7.1f} us  read {mb:7.2f} MB  "
                  f"DRAM {m.get('DRAM Throughput', '?'):>6}%  occupancy {m.get('Achieved Occupancy', '?'):>6}%  "
                  f"{m.get('Registers Per Thread', '?')} regs")
        return
    files = sorted(glob.glob(os.path.join(args.dir, "ncu-*.csv*")), key=lambda p: int(re.findall(r"ncu-(\d+)", p)[-1]))
    table = {}
    for path in files:
        i = int(re.findall(r"ncu-(\d+)", path)[-1])
        table[i] = summarize(read(path), cases, args.reps)
    if args.best:
        timed = {i: t[args.best]["expand"]["us"] for i, t in table.items() if "expand" in t.get(args.best, {})}
        print(min(timed, key=timed.get) if timed else 0)
        return
    if args.json:
        print(json.dumps(table, indent=1))
        return
    for i, t in table.items():
        print(f"setting {i}")
        for case, kinds in t.items():
            for kind, d in kinds.items():
                print(f"  {case:>8} {kind:7s} {d['us']:7.1f} us  DRAM {d['dram_pct']:5.1f}%  occupancy "
                      f"{d['occupancy_pct']:5.1f}%  {d['registers']:.0f} regs  grid {d['grid']}")


if __name__ == "__main__":
    main()
