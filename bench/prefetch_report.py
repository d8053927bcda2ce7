"""How much of the cold-adapter cost a prefetch hides (issue 5), from run.py trace JSONs.

Three runs of one trace (same workload and seed, `--variant`s of one process): a reference where
no request pays for its adapter (every file in the host cache), then prefetch on and prefetch off
in the setting under test (e.g. a small host cache, so cold adapters come from disk). A request's
cold cost in a run is its time to first token there minus its time to first token in the
reference. A request with no first token (aborted, cut off) counts the time it waited: to its
abort, or to the run's end. Cold and warm requests both count: without a prefetch a disk read in
the step loop stalls every request of the step, not only the cold one.

    hidden = 1 - cost(prefetch on) / cost(prefetch off)          (mean and median over requests)

    python bench/prefetch_report.py bench/results/<folder>/        # pairs variants by name
    python bench/prefetch_report.py --ref A.json --on B.json --off C.json

Pairing by name: every `*prefetch-on[-R<rate>]<suffix>.json` whose suffix is not empty (e.g.
"-disk") with the same name with "on" -> "off" (or, for a suffix ending in "-w<N>", a stage_workers
setting, the off twin without it), against the name without the suffix as the reference.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np


def waited(run: dict) -> dict[int, float]:
    """Trace index -> seconds from arrival to first token (or to abort, or to the run's end)."""
    end = run["pool"]["wall_s"]
    out = {}
    for r in run.get("requests") or []:
        t = r["first_token_s"]
        if t is None:
            t = r["finish_s"] if r["finish_s"] is not None else end
        out[r["index"]] = max(t - r["arrival_s"], 0.0)
    return out


def hidden_share(ref: dict, on: dict, off: dict) -> dict:
    """The cold cost with prefetch on and off over the requests all three runs hold, and the share
    of it that the prefetch hides (mean and median)."""
    w_ref, w_on, w_off = waited(ref), waited(on), waited(off)
    idx = sorted(set(w_ref) & set(w_on) & set(w_off))
    if not idx:
        raise ValueError("the runs share no requests (run.py --no-requests drops them)")
    base = np.array([w_ref[i] for i in idx])
    cost_on = np.array([w_on[i] for i in idx]) - base
    cost_off = np.array([w_off[i] for i in idx]) - base
    out = {"requests": len(idx)}
    for stat, f in (("mean", np.mean), ("median", np.median)):
        c_on, c_off = float(f(cost_on)), float(f(cost_off))
        out[f"cost_on_{stat}_s"], out[f"cost_off_{stat}_s"] = c_on, c_off
        # No cost without the prefetch: nothing to hide, and no share to report.
        out[f"hidden_{stat}"] = 1.0 - c_on / c_off if c_off > 0 else None
    return out


def pairs(folder: Path) -> list[tuple[str, Path, Path, Path]]:
    found = []
    for on in sorted(folder.glob("*prefetch-on*.json")):
        m = re.fullmatch(r"(.*prefetch-)on(-R[\d.]+)?(-.+)?\.json", on.name)
        if not m or not m.group(3):
            continue
        # An on-variant's own knobs ("-w8": stage_workers) do not change prefetch off: its off
        # twin may be the one without them.
        offs = [on.with_name(f"{m.group(1)}off{m.group(2) or ''}{sfx}.json")
                for sfx in dict.fromkeys([m.group(3), re.sub(r"(-w\d+)+$", "", m.group(3))])]
        off = next((o for o in offs if o.is_file()), None)
        ref = on.with_name(f"{m.group(1)}on{m.group(2) or ''}.json")
        if off is not None and ref.is_file():
            found.append((on.stem, ref, on, off))
    return found


def _pct(h: float | None) -> str:
    return "n/a" if h is None else f"{h:.0%}"


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", nargs="?", help="a results folder: pair its prefetch variants by name")
    ap.add_argument("--ref"), ap.add_argument("--on"), ap.add_argument("--off")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if args.folder:
        todo = pairs(Path(args.folder))
        if not todo:
            print(f"no prefetch on/off/reference triple in {args.folder}", file=sys.stderr)
    elif args.ref and args.on and args.off:
        todo = [(Path(args.on).stem, Path(args.ref), Path(args.on), Path(args.off))]
    else:
        ap.error("give a results folder, or --ref, --on and --off")
    rows = []
    for name, ref, on, off in todo:
        row = {"variant": name, "ref": ref.name, "on": on.name, "off": off.name,
               **hidden_share(*(json.loads(p.read_text()) for p in (ref, on, off)))}
        rows.append(row)
        print(f"{name}: cold cost on / off, mean {row['cost_on_mean_s']:.3f} / {row['cost_off_mean_s']:.3f} s, "
              f"median {row['cost_on_median_s']:.3f} / {row['cost_off_median_s']:.3f} s; prefetch hides "
              f"{_pct(row['hidden_mean'])} (mean), {_pct(row['hidden_median'])} (median) over {row['requests']} requests")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
