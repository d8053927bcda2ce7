"""What of a compiled GPU program runs inside command buffers (CUDA graphs) and what the host
launches one by one: reads an XLA dump's `*after_optimizations.txt` (XLA_FLAGS="--xla_dump_to=DIR
--xla_dump_hlo_as_text") and counts the entry computation's instructions by kind, the calls into
command-buffer computations among them.

    python bench/hlo_commands.py DIR [--match forward_sample]
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import re


def entry_counts(text: str) -> dict:
    """Instructions of the ENTRY computation by opcode (custom calls by target, calls into
    command buffers as 'command_buffer')."""
    m = re.search(r"^ENTRY [^\n]*\{\n(.*?)^\}", text, re.S | re.M)
    body = m.group(1) if m else ""
    counts = collections.Counter()
    for line in body.splitlines():
        op = re.search(r"=\s*(?:\([^=]*?\)|[\w\[\]{},:. ]*?)\s+([\w-]+)\(", line)
        if not op:
            continue
        name = op.group(1)
        if name in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
            continue
        if name == "custom-call":
            t = re.search(r'custom_call_target="([^"]+)"', line)
            name = f"custom-call:{t.group(1) if t else '?'}"
        elif name == "call" and "command_buffer" in line:
            name = "command_buffer"
        counts[name] += 1
    return dict(counts.most_common())


def fusion_bodies(text: str, pattern: str, limit: int = 3) -> dict:
    """The fused computations that entry instructions named like `pattern` (a regex, e.g.
    "loop_reduce_fusion") call, by instruction name, at most `limit`: what such a kernel does."""
    m = re.search(r"^ENTRY [^\n]*\{\n(.*?)^\}", text, re.S | re.M)
    out = {}
    for line in (m.group(1) if m else "").splitlines():
        name = re.match(r"\s*(?:ROOT\s+)?%?([\w.-]+)\s*=", line)
        calls = re.search(r"calls=%?([\w.-]+)", line)
        if not (name and calls and re.search(pattern, name.group(1))):
            continue
        body = re.search(rf"^%?{re.escape(calls.group(1))} [^\n]*\{{\n.*?^\}}", text, re.S | re.M)
        out[name.group(1)] = body.group(0) if body else "?"
        if len(out) >= limit:
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dump_dir")
    ap.add_argument("--match", default="forward_sample")
    ap.add_argument("--show", default=None, help="regex: also print the fused computations of entry "
                                                 "instructions so named (e.g. loop_reduce_fusion; HLO names "
                                                 "them with '.', where a trace's kernel names have '_')")
    ap.add_argument("--limit", type=int, default=3, help="at most this many fused computations a module")
    args = ap.parse_args()
    out = {}
    for path in sorted(glob.glob(f"{args.dump_dir}/*{args.match}*after_optimizations.txt")):
        text = open(path).read()
        out[path.rsplit("/", 1)[-1]] = {"entry": entry_counts(text),
                                        "command_buffer_computations": len(re.findall(r"^%?command_buffer[\w.]* ", text, re.M))}
        if args.show:
            out[path.rsplit("/", 1)[-1]]["fusions"] = fusion_bodies(text, args.show, args.limit)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
