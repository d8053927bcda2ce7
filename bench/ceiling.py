"""The memory-traffic ceiling of "unified ÷ base model" throughput on a decode-bound trace.

A decode step reads the model's weights once, every running sequence's KV cache, and (with
adapters) the A and B of every distinct adapter in the batch. If both engines moved bytes equally
fast, unified ÷ base could be at most base bytes ÷ (base bytes + adapter bytes) per step at the
same batch. S-LoRA's S2 at n = 1000 (alpha = 1: nearly one adapter per row) gives ~0.84 a decode
step (session 11: 172 rows on ~156 adapters) and ~0.88 over all steps (`--base`).

    python bench/ceiling.py bench/results/20261129-3db7756/S2-unified-n1000-R40-overlap.json
    python bench/ceiling.py RUN.json --base BASE.json   # also over all steps, prefill included

reads the run's workload (model, ranks, length ranges, target modules q/k/v/o) and its measured
rows and distinct adapters a decode step; `--rows/--adapters/--context` override them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")  # the traces' adapters (bench/run.py TARGETS)


def mean_decode_context(input_range, output_range) -> float:
    """Mean context length over all decode tokens of requests whose prompt and output lengths are
    uniform integers in [lo, hi) (numpy randint, as the trace draws them): a request with output o
    decodes at contexts p+1 .. p+o, so longer outputs weigh more."""
    (ilo, ihi), (olo, ohi) = input_range, output_range
    prompt = (ilo + ihi - 1) / 2
    outs = range(olo, ohi)
    return prompt + sum(o * (o + 1) / 2 for o in outs) / sum(outs)


def step_bytes(cfg, rows: float, context: float, adapters: float, mean_rank: float,
               modules=MODULES, itemsize: int = 2) -> tuple[float, float]:
    """(base bytes, adapter bytes) one decode step reads: the weights (the embedding table only
    as rows, the LM head in full), rows x context tokens of K and V in every layer, and A (in x r)
    plus B (r x out) of each distinct adapter on each module of each layer."""
    emb = cfg.vocab_size * cfg.hidden_size
    weights = cfg.num_params() - (emb if not cfg.tie_word_embeddings else 0)
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.kv_size
    per_rank = cfg.num_hidden_layers * sum(sum(cfg.module_shape(m)) for m in modules)
    return (weights + rows * context * kv_per_token) * itemsize, adapters * mean_rank * per_rank * itemsize


def blended_ceiling(base_run: dict, decode_ceiling: float) -> dict:
    """Unified / base over a whole run at the decode ceiling: the base run's prefill and decode
    steps, prefill at its own time (no adapter bytes: an upper bound) and decode at its time /
    decode_ceiling."""
    k = base_run["pool"]["steps_by_kind"]
    pre = k["prefill_steps"] * k["prefill_step_s_mean"]
    dec = k["decode_steps"] * k["decode_step_s_mean"]
    return {"base_prefill_share": pre / (pre + dec), "ceiling_all_steps": (pre + dec) / (pre + dec / decode_ceiling)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="a bench/run.py trace JSON (unified mode)")
    ap.add_argument("--rows", type=float, default=None, help="sequences a decode step (default: the run's)")
    ap.add_argument("--adapters", type=float, default=None, help="distinct adapters a decode step (default: the run's)")
    ap.add_argument("--context", type=float, default=None, help="mean context (default: from the length ranges)")
    ap.add_argument("--base", default=None,
                    help="the base model's run on the same trace: also the ceiling over all steps, its prefill "
                         "steps (which carry a prompt or two, i.e. hardly any adapter bytes) counted at their "
                         "measured time and its decode steps stretched by the decode ceiling")
    args = ap.parse_args(argv)
    from slora_jax.model.config import load_model_config

    run = json.loads(Path(args.run).read_text())
    w, k = run["workload"], run["pool"]["steps_by_kind"]
    cfg = load_model_config(w["model"])
    # Decode steps' own means where the run has them (run.py since session 11); older runs have
    # the means over all steps, which prefill steps (a prompt or two each) pull down.
    rows = args.rows if args.rows is not None else k.get("decode_seqs_per_step_mean") or k["seqs_per_step_mean"]
    adapters = args.adapters if args.adapters is not None else \
        k.get("decode_adapters_per_step_mean") or k["adapters_per_step_mean"]
    context = args.context if args.context is not None else mean_decode_context(w["input_range"], w["output_range"])
    mean_rank = sum(w["ranks"]) / len(w["ranks"])  # adapter i has rank ranks[i % len(ranks)]
    base, lora = step_bytes(cfg, rows, context, adapters, mean_rank)
    out = {"run": args.run, "model": w["model"], "rows": rows, "adapters": adapters, "mean_rank": mean_rank,
           "mean_context": context, "base_GB": base / 1e9, "adapter_GB": lora / 1e9,
           "ceiling": base / (base + lora)}
    if args.base:
        out.update(blended_ceiling(json.loads(Path(args.base).read_text()), out["ceiling"]))
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
