"""Kernel benchmark: LoRA shrink+expand and paged decode attention, side by side.

    python bench/kernels.py --out bench/results/kernels-h200.json          # on the GPU (~4 min)
    JAX_PLATFORMS=cpu python bench/kernels.py --quick --out /tmp/k.json     # smoke test, CPU

LoRA delta (shrink x@A, then expand @B) for decode batches of T tokens over n distinct adapters,
T/n tokens each, grouped by adapter as the engine groups them; slot s has rank RANKS[s % len(RANKS)]
(mixed ranks); max rank 64 (the engine's bucket). Module shapes of llama-7b: q/k/v/o (H->H), gate/up
(H->I), down (I->H); pool width W = kv_size. Variants, timed in one run on the same inputs:

  pallas   pallas_kernels.lora.lora_apply into a zero y of `--y-dtype` (float32: what
           lora_delta(backend="pallas") does): the segment-form Triton-lowered kernels,
           given the schedules built on the host (pallas_kernels.lora.block_schedule and
           shrink_schedule), as the engine passes them; the expand reads the shrink's padded xa
           directly, as in the engine
  xla-ref  lora_delta(backend="xla"): the jnp reference beside the kernels
  one-hot  slora_jax.lora.lora_xla: the engine's xla path, every adapter padded to max rank and a
           one-hot over slots per token (the sglang-jax / vLLM-TPU style einsum)
  padded   vLLM-style slots: dense per-slot A [n, in, 64] and B [n, 64, out], zero past each rank,
           gathered per token (A[slot] -> bmm), in jnp
  ranksplit triton_kernels.ranksplit into a zero y: one launch, a program per rank_rows rank rows of
           an adapter doing its share of the shrink and of the expand, vector atomic adds into y; its
           table built on the host (plan); settings by --lora-blocks '{"ranksplit": {...}}'. n/a
           without jax-triton or where a row is not a power-of-two count of chunks (MLP at W 4096)

Inputs: one pool of rows [N, W] per module shape (bf16, random normal, larger than L2); each adapter
is a set of rows at random positions of it (the A^T and B rows the engine's layout puts there); the
index entries past an adapter's rows point at random rows. A case times K input sets in rotation
(different x and different adapters, K*set bytes >= ~128 MB where that takes at most 12 sets), the K
calls unrolled in one jit so Python dispatch does not count; time = median over `--iters` timed
iterations of (wall time of `reps` back-to-back calls, block_until_ready) / (reps * K).
At small cases the host's dispatch of those jitted calls still outlasts the device's work (on the
H200 a plain copy of 64 tokens x 32 adapters' 18 MB shows 48% of copy bandwidth on the wall clock
and 93% on the device), so `--device-time` also traces one round of the timed calls
and reports the kernels' own busy time per call (JSON "device"; printed under each case and on
the targets line): the measure of a kernel's achieved bandwidth where the two differ.

Bytes that must move, per call: x read once; each distinct adapter's real-rank A [r, in] and B [r,
out] read once; y ([T, out], `--y-dtype`) written once and read once by expand. y is float32 by
default (a delta buffer); `--y-dtype bfloat16` is the
engine's form, in which the expand adds into the bf16 output of the base projection in place (and
the kernel holds y in bf16 registers through its rank loop: a float32 y costs the expand ~30 more
registers a thread). Achieved bandwidth =
bytes / time, reported as a fraction of the copy bandwidth (bench/engine_bench.copy_bandwidth: an
elementwise a*1.0001 over 2 GiB, read + write). Every variant's output is checked against the xla
reference on the same inputs before it is timed (max |diff| / max |ref| < 2e-2); the error is in the
JSON, and a "!" marks a failed check in the table. A case's "speedup" is each other variant's time
over pallas' (speedup["onehot"] > 1: pallas is faster than one-hot).

`--read-floor` also times bench/read_floor.py on each case's rows: the A^T and B rows gathered and
summed, nothing else, in one launch and in two (A, then B): what any pair that reads them from the
pool can show at most on this measure (JSON "read_floor"; the targets line).

Paged decode attention: B = 64 sequences of 1024 context tokens each in a pool [pages, 2, ps, W],
pages in random order, page sizes 16 and 1; GQA (llama-3-8b per layer: 32 q heads, 8 kv heads,
d 128) and MHA (llama-7b: 32/32); the Pallas kernel against paged_decode_attention_reference.
Bytes = the valid KV (B*ctx*2*W*2) + q + out.

The table comes last (the device call returns only the tail of the output); the JSON has everything,
with commit, device and command. The targets (TARGETS) are printed PASS / FAIL / n.a.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == REPO / "bench":
    sys.path[0] = str(REPO)  # run as a script: bench/trace.py must not shadow the stdlib's trace

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.engine_bench import copy_bandwidth  # noqa: E402
from bench.provenance import git_commit  # noqa: E402
from bench import read_floor as rf  # noqa: E402
from bench.kernels_timing import TOL, _add_fracs, _err, measure, run_variant  # noqa: E402
from bench.kernels_report import (FLOOR_FORMS, LABELS, OURS, VARIANTS, _cell, _floor_cell,  # noqa: E402
                                  _pct, table, targets)
from pallas_kernels import lora as lora_kernels  # noqa: E402
from pallas_kernels.lora import lora_delta  # noqa: E402
from pallas_kernels.paged_attention import (MIN_DOT, paged_decode_attention,  # noqa: E402
                                            paged_decode_attention_reference)
from slora_jax.lora import lora_xla  # noqa: E402
from triton_kernels import ranksplit  # noqa: E402 (imports jax-triton lazily)

L2_BYTES = 50 << 20          # H200 L2
ROTATE_BYTES = 128 << 20     # rotate input sets until K * set bytes reach this (at most MAX_SETS)
MAX_SETS = 12
# The kernels' settings for this run: this device's tuned ones, with --lora-blocks over them (main)
SETTINGS: dict = {}


def kernel_settings(over: str | None = None, device_kind: str | None = None) -> dict:
    """{"shrink", "expand", "ranksplit"}: the device's tuned settings (block_sizes.get_default),
    each kernel's entries of `over` (JSON text, by kernel) replacing those."""
    from pallas_kernels.block_sizes import from_dict
    classes = {"shrink": lora_kernels.ShrinkBlockSizes, "expand": lora_kernels.ExpandBlockSizes,
               "ranksplit": ranksplit.RanksplitBlockSizes}
    out = {k: c.get_default(device_kind) for k, c in classes.items()}
    for kind, values in (json.loads(over) if over else {}).items():
        if kind not in classes:
            raise ValueError(f"unknown kernel {kind!r}; one of {sorted(classes)}")
        out[kind] = from_dict(classes[kind], {**dataclasses.asdict(out[kind]), **values})
    return out

FULL = dict(hidden=4096, width=4096, inter=11008, tokens=(64, 256), adapters=(1, 8, 32, 64),
            ranks=(8, 16, 32, 64), max_rank=64, per_class=64, min_pool_rows=32768, iters=20,
            warmup=2, iter_s=2e-3, attn_batch=64, attn_context=1024, page_sizes=(16, 1),
            attn_models=(("llama-3-8b", 32, 8, 128), ("llama-7b", 32, 32, 128)),
            target_tokens=64, target_adapters=32, budget_s=230.0, copy_bytes=2 << 30, copy_iters=20)
QUICK = dict(hidden=64, width=32, inter=160, tokens=(8,), adapters=(1, 2), ranks=(4, 8),
             max_rank=8, per_class=4, min_pool_rows=1024, iters=2, warmup=1, iter_s=0.0,
             attn_batch=4, attn_context=32, page_sizes=(4, 1),
             attn_models=(("gqa-toy", 4, 2, 16), ("mha-toy", 4, 4, 16)),
             target_tokens=8, target_adapters=2, budget_s=0.0, copy_bytes=64 << 20, copy_iters=3)


# ---------------------------------------------------------------------------------------------
# Timing and checking.


def _next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


class LoraPool:
    """One module shape: a pool of rows [N, W] and a universe of adapters in it. Adapter m has rank
    ranks[m % C]; its A^T rows and B rows sit at random pool rows; index entries past them point at
    random rows (the kernels must not read them). With o["page_rows"] = P, rows are placed as the
    engine's allocator places them instead: each adapter's A^T then B rows fill whole pages of P
    consecutive rows, the pages at random places in the pool."""

    def __init__(self, name, fin, fout, o, seed):
        self.name, self.fin, self.fout = name, fin, fout
        width, rmax, cyc = o["width"], o["max_rank"], o["ranks"]
        self.width, self.max_rank, self.cycle = width, rmax, cyc
        rng = np.random.default_rng(seed)
        m_count = o["per_class"] * len(cyc)
        self.ranks = np.array([cyc[m % len(cyc)] for m in range(m_count)], np.int32)
        a_used = -(-self.ranks * fin // width)
        b_used = -(-self.ranks * fout // width)
        used = a_used + b_used
        page = o.get("page_rows") or 0
        units = -(-used // page) if page else used  # each adapter's pages (whole), or rows
        need = int(units.sum()) * (page or 1)
        n_rows = max(o["min_pool_rows"], _next_pow2(int(need * 1.25)))
        order = rng.permutation(n_rows // (page or 1))  # pages, or rows, in random order
        ra, rb = -(-rmax * fin // width), -(-rmax * fout // width)
        self.a_idx = rng.integers(0, n_rows, (m_count, ra)).astype(np.int32)
        self.b_idx = rng.integers(0, n_rows, (m_count, rb)).astype(np.int32)
        ends = np.cumsum(units)
        runs = [order[e - k:e] for e, k in zip(ends, units)]
        if page:  # adapter m's rows: consecutive within its pages
            runs = [(r[:, None] * page + np.arange(page)[None, :]).reshape(-1) for r in runs]
        for m, rows in enumerate(runs):
            self.a_idx[m, :a_used[m]] = rows[:a_used[m]]
            self.b_idx[m, :b_used[m]] = rows[a_used[m]:used[m]]
        self.rows = jax.random.normal(jax.random.PRNGKey(seed), (n_rows, width), jnp.bfloat16)
        self.n_rows, self.per_class = n_rows, o["per_class"]

    def bytes(self, t: int, n: int, y_bytes: int = 4) -> dict:
        ranks = [self.cycle[s % len(self.cycle)] for s in range(n)]
        b = {"x": t * self.fin * 2, "adapters": sum(r * (self.fin + self.fout) * 2 for r in ranks),
             "y": 2 * t * self.fout * y_bytes}
        b["total"] = sum(b.values())
        return b

    def sets(self, t: int, n: int, k_sets: int, seed: int) -> list[dict]:
        """K input sets; set k's slot s is adapter j*C + s%C, j cycling through the universe so the
        sets touch different adapters until it wraps."""
        c = len(self.cycle)
        per = -(-n // c)
        out = []
        bt = lora_kernels.BLOCK_T  # the engine's decode expand; its shrink at 1 where gemv_shrink holds
        shrink_bt = 1 if lora_kernels.gemv_shrink(self.width, self.fin, SETTINGS["shrink"]) else bt
        seg = np.arange(n + 1, dtype=np.int32) * (t // n)  # every set: n slots of t // n tokens

        def dev(schedule):
            return tuple(map(jnp.asarray, schedule))
        for k in range(k_sets):
            m = np.array([((k * per + s // c) % self.per_class) * c + s % c for s in range(n)])
            ranks = self.ranks[m]
            out.append({
                "x": jax.random.normal(jax.random.PRNGKey(seed * 1000 + k), (t, self.fin),
                                       jnp.bfloat16),
                "a_rows": jnp.asarray(self.a_idx[m]), "b_rows": jnp.asarray(self.b_idx[m]),
                "ranks": jnp.asarray(ranks),
                "seg": jnp.asarray(seg),
                # the kernels' block schedules, built on the host as the engine builds them
                "schedule": dev(lora_kernels.block_schedule(ranks, seg, t, bt)),
                "shrink_schedule": dev(lora_kernels.shrink_schedule(ranks, seg, t, shrink_bt, max_rank=self.max_rank,
                                                                    rank_tile=SETTINGS["shrink"].rank_tile)),
                "tok": jnp.asarray(np.repeat(np.arange(n, dtype=np.int32), t // n)),
            })
            if ranksplit.applies(self.width, self.fin, self.fout):  # its table, on the host as the engine's
                out[-1]["ranksplit_table"] = dev(ranksplit.plan(
                    ranks, self.a_idx[m], self.b_idx[m], seg, t, fin=self.fin, fout=self.fout, width=self.width,
                    max_rank=self.max_rank, block_sizes=SETTINGS["ranksplit"]))
        return out


def _dense_slots(rows, a_rows, b_rows, ranks, *, max_rank, fin, fout):
    """vLLM-style slot stacks from the pool: A [n, in, R] and B [n, R, out], zero past each rank."""
    n = a_rows.shape[0]
    live = (jnp.arange(max_rank)[None, :] < ranks[:, None])[:, :, None]
    a = rows[a_rows].reshape(n, -1)[:, :max_rank * fin].reshape(n, max_rank, fin)
    b = rows[b_rows].reshape(n, -1)[:, :max_rank * fout].reshape(n, max_rank, fout)
    return jnp.where(live, a, 0).transpose(0, 2, 1), jnp.where(live, b, 0)


dense_slots = jax.jit(_dense_slots, static_argnames=("max_rank", "fin", "fout"))


def padded_bmm(x, a, b, tok):
    """Padded max-rank batched matmul: each token gathers its slot's dense A and B (vLLM slots)."""
    xa = jnp.einsum("ti,tir->tr", x, a[tok], preferred_element_type=jnp.float32).astype(x.dtype)
    return jnp.einsum("tr,tro->to", xa, b[tok], preferred_element_type=jnp.float32)


def same_bytes_copy(nbytes: int, k_sets: int, bw: float, opts) -> dict | None:
    """The copy-bandwidth kernel (engine_bench.copy_bandwidth's a * 1.0001) over nbytes / 2 bytes,
    so it reads and writes as many bytes as the case must move, timed like the variants (k_sets
    buffers in rotation): what one bandwidth-bound launch achieves at this size, the case's
    practical ceiling. None where it fails."""
    n = max(1, nbytes // 4)  # bf16 elements: n * 2 bytes read + n * 2 written
    try:
        sets = [jax.random.normal(jax.random.PRNGKey(i), (n,), jnp.bfloat16) for i in range(k_sets)]
        res, _ = run_variant(lambda _, a: a * 1.0001, None, sets, iters=opts["iters"], warmup=opts["warmup"],
                             iter_s=opts["iter_s"], device_time=opts.get("device_time", False))
    except Exception as e:  # noqa: BLE001
        return {"error": _err(e)}
    return _add_fracs(res, 4 * n, bw)




def paged_read_floor(pool: LoraPool, sets: list[dict], nbytes: int, bw: float, opts) -> dict:
    """bench/read_floor.py on the case's own sets: its A^T and B rows gathered and nothing else, in
    one launch (A and B rows), in two launches one after the other on the stream (A rows, then B
    rows: the order a two-launch pair must keep), and in those two launches with one more
    dependent trip before each program's gather ("_hop": its tile's place read from a shuffled
    table first). Each form is the best over rf.TILINGS by the device's busy time where traced
    (else the wall clock); a pool narrower than every tiling (--quick) reads whole rows. Bytes:
    the case's (nbytes), so its fractions read beside the pair's as the most that pair could
    show. Each tiling's output is checked against rf.read_reference on the first set."""
    idx = [rf.live_rows(s["a_rows"], s["b_rows"], s["ranks"], pool.fin, pool.fout, pool.width) for s in sets]
    rng = np.random.default_rng(0)
    idx_sets = [tuple(jnp.asarray(v) for v in (a, b, np.concatenate([a, b]),
                                              rng.permutation(len(a) // rf.TILE_ROWS).astype(np.int32),
                                              rng.permutation(len(b) // rf.TILE_ROWS).astype(np.int32)))
                for a, b in idx]
    interp = opts["interpret"]
    out: dict = {"rows": [int(len(a)) for a in idx[0]]}
    for form in FLOOR_FORMS:
        tried = {}
        for col_tile, splits in [t for t in rf.TILINGS if pool.width % (t[0] * t[1]) == 0] or [(pool.width, 1)]:
            kw = dict(col_tile=col_tile, splits=splits, interpret=interp)

            def fn(rows, s, kw=kw, form=form):
                if form == "one_launch":
                    return rf.paged_read(rows, s[2], **kw)
                hop = form.endswith("_hop")
                return (rf.paged_read(rows, s[0], s[3] if hop else None, **kw),
                        rf.paged_read(rows, s[1], s[4] if hop else None, **kw))
            try:
                res, outs = run_variant(fn, pool.rows, idx_sets, iters=opts["iters"], warmup=opts["warmup"],
                                        iter_s=opts["iter_s"], device_time=opts.get("device_time", False))
            except Exception as e:  # noqa: BLE001: one tiling failing must not lose the others
                tried[f"{col_tile}x{splits}"] = {"error": _err(e)}
                continue
            a, b, ab, oa, ob = idx_sets[0]
            if form == "one_launch":
                got, want = outs[0], rf.read_reference(pool.rows, ab, splits=splits)
            else:
                hop = form.endswith("_hop")
                got = jnp.concatenate(outs[0])
                want = jnp.concatenate([rf.read_reference(pool.rows, v, o if hop else None, splits=splits)
                                        for v, o in ((a, oa), (b, ob))])
            res["rel_err"] = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
            res["ok"] = res["rel_err"] < 1e-3
            tried[f"{col_tile}x{splits}"] = _add_fracs(res, nbytes, bw)
            del outs

        def cost(r):
            return (r.get("device") or {}).get("busy_us") or r["us"]
        good = {k: r for k, r in tried.items() if r.get("ok")}
        best = min(good, key=lambda k: cost(good[k])) if good else None
        out[form] = {"best": best, **(good[best] if best else {}),
                     "tilings": {k: ({"us": r["us"], "busy_us": (r.get("device") or {}).get("busy_us"),
                                      "ok": r["ok"]} if "us" in r else r) for k, r in tried.items()}}
    return out


def bench_lora_case(pool: LoraPool, t: int, n: int, bw: float, opts, seed: int) -> dict:
    fin, fout, rmax = pool.fin, pool.fout, pool.max_rank
    ydt = jnp.dtype(opts.get("y_dtype", "float32"))
    by = pool.bytes(t, n, ydt.itemsize)
    set_bytes = by["x"] + by["adapters"] + by["y"] // 2
    k_sets = 2 if opts["quick"] else max(2, min(MAX_SETS, -(-ROTATE_BYTES // set_bytes)))
    sets = pool.sets(t, n, k_sets, seed)
    interp = opts["interpret"]
    kw = dict(max_rank=rmax, fin=fin, fout=fout)
    # the Pallas pair's, as pool.sets built its schedules
    block_t = lora_kernels.BLOCK_T
    shrink_bt = 1 if lora_kernels.gemv_shrink(pool.width, fin, SETTINGS["shrink"]) else block_t

    def args(s):
        return s["x"], s["a_rows"], s["b_rows"], s["ranks"], s["seg"]

    def pallas(rows, s):
        x, a, b, r, seg = args(s)
        # y in ydt, the kernel's output dtype (bfloat16: the engine's form, which adds into the
        # base projection's bf16 output in place; float32: a delta buffer)
        return lora_kernels.lora_apply(jnp.zeros((t, fout), ydt), x, rows, a, b, r, seg, interpret=interp,
                                       schedule=s["schedule"], shrink_schedule=s["shrink_schedule"],
                                       block_t=block_t, shrink_block_t=shrink_bt, shrink_sizes=SETTINGS["shrink"],
                                       expand_sizes=SETTINGS["expand"], **kw)

    def xla_ref(rows, s):
        x, a, b, r, seg = args(s)
        return lora_delta(x, rows, a, b, r, seg, backend="xla", **kw).astype(ydt)

    def onehot(rows, s):
        return lora_xla(s["x"], rows, s["a_rows"], s["b_rows"], s["ranks"], s["tok"], rmax, fin,
                        fout).astype(ydt)

    def padded(_, s):
        return padded_bmm(s["x"], s["A"], s["B"], s["tok"]).astype(ydt)

    padded_sets = []

    def sets_of(name):
        if name != "padded":
            return sets
        if not padded_sets:  # built on first use, untimed (vLLM keeps its slot stacks resident)
            for s in sets:
                a, b = dense_slots(pool.rows, s["a_rows"], s["b_rows"], s["ranks"], **kw)
                padded_sets.append({"x": s["x"], "A": a, "B": b, "tok": s["tok"]})
        return padded_sets

    def rank_split(rows, s):
        return ranksplit.ranksplit_apply(jnp.zeros((t, fout), ydt), s["x"], rows, s["ranksplit_table"], fin=fin, fout=fout,
                                         slots=n, block_sizes=SETTINGS["ranksplit"])

    variants = {"xla_ref": xla_ref, "pallas": pallas, "onehot": onehot, "padded": padded,
                "ranksplit": rank_split if opts["triton"] and "ranksplit_table" in sets[0]
                and ranksplit.applies(pool.width, fin, fout, ydt) else None}
    if opts.get("lora_variants"):  # a sweep times only the named ones (the reference always runs)
        variants = {k: (v if k == "xla_ref" or k in opts["lora_variants"] else None) for k, v in variants.items()}
    res = measure(variants, "xla_ref", lambda name: None if name == "padded" else pool.rows,
                  sets_of, by["total"], bw, opts)
    padded_sets.clear()
    same = same_bytes_copy(by["total"], k_sets, bw, opts)
    floor = paged_read_floor(pool, sets, by["total"], bw, opts) if opts.get("read_floor") else None
    ranks = [pool.cycle[s % len(pool.cycle)] for s in range(n)]
    out = {"module": pool.name, "fin": fin, "fout": fout, "tokens": t, "adapters": n, "y_dtype": ydt.name,
           "ranks": sorted(set(ranks)), "mixed_ranks": len(set(ranks)) > 1, "max_rank": rmax,
           "width": pool.width, "pool_rows": pool.n_rows, "bytes": by, "sets": k_sets,
           "set_bytes": set_bytes, "sets_exceed_l2": k_sets * set_bytes > L2_BYTES,
           "pallas_kernel": min(lora_kernels._col_tile(pool.width, fin, SETTINGS["shrink"].col_tile),
                                lora_kernels._col_tile(pool.width, fout, SETTINGS["expand"].col_tile)) >= 16,
           "variants": {v: res[v] for v in VARIANTS}, "same_bytes_copy": same, "read_floor": floor}
    p = res["pallas"]
    out["speedup"] = {other: (res[other]["us"] / p["us"]
                              if p and "us" in p and res[other] and "us" in res[other] else None)
                      for other in VARIANTS if other != "pallas"}
    return out


# ---------------------------------------------------------------------------------------------
# Paged decode attention.


def bench_attention_case(model: str, nh: int, kvh: int, d: int, ps: int, bw: float, opts,
                         seed: int) -> dict:
    bsz, ctx = opts["attn_batch"], opts["attn_context"]
    width = kvh * d
    rng = np.random.default_rng(seed)
    per_seq = -(-ctx // ps)
    used = bsz * per_seq
    total = int(used * 1.25) + 1  # page 0 is the null page; the rest in random order
    page_table = rng.permutation(np.arange(1, total))[:used].reshape(bsz, per_seq).astype(np.int32)
    pool = jax.random.normal(jax.random.PRNGKey(seed), (total, 2, ps, width), jnp.bfloat16)
    shared = (pool, jnp.asarray(page_table), jnp.full((bsz,), ctx, jnp.int32))
    sets = []
    for k in range(2):
        kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed * 100 + k), 3)
        sets.append((jax.random.normal(kq, (bsz, nh, d), jnp.bfloat16),
                     jax.random.normal(kk, (bsz, kvh, d), jnp.bfloat16),
                     jax.random.normal(kv, (bsz, kvh, d), jnp.bfloat16)))
    interp = opts["interpret"]

    def pallas(sh, s):
        return paged_decode_attention(*s, *sh, interpret=interp)

    def reference(sh, s):
        return paged_decode_attention_reference(*s, *sh)

    by = {"kv": bsz * ctx * 2 * width * 2, "q": bsz * nh * d * 2, "out": bsz * nh * d * 2}
    by["total"] = sum(by.values())
    res = measure({"reference": reference, "pallas": pallas}, "reference", lambda _: shared,
                  lambda _: sets, by["total"], bw, opts)
    p, r = res["pallas"], res["reference"]
    return {"model": model, "q_heads": nh, "kv_heads": kvh, "head_dim": d, "width": width,
            "page_size": ps, "batch": bsz, "context": ctx, "pool_pages": total, "bytes": by,
            "pallas_kernel": d >= MIN_DOT and d & (d - 1) == 0,
            "variants": res,
            "speedup": (r["us"] / p["us"] if p and "us" in p and r and "us" in r else None)}


# ---------------------------------------------------------------------------------------------
# Targets and the table.


def _ints(text: str | None, default):
    return tuple(int(v) for v in text.split(",")) if text else default


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="tiny shapes, interpret mode: CPU smoke run")
    ap.add_argument("--out", default=None, help="JSON output path")
    ap.add_argument("--tokens", default=None, help="comma list (default 64,256)")
    ap.add_argument("--adapters", default=None, help="comma list (default 1,8,32,64)")
    ap.add_argument("--modules", default="qkvo,gate_up,down",
                    help="comma list of qkvo,gate_up,down")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations (median)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new case after this many seconds (0: no limit)")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: attention,lora")
    ap.add_argument("--lora-blocks", default=None,
                    help='JSON of kernel settings over this device\'s defaults, by kernel ("shrink", "expand", '
                         '"ranksplit"), e.g. \'{"shrink": {"split_k": 4, "col_tile": 512}}\' (a tuning sweep: one run each)')
    ap.add_argument("--device-time", action="store_true",
                    help="also trace each variant's calls once and report the device's kernel time per call "
                         "(JSON \"device\"; the table's wall-clock times include host dispatch and launch gaps)")
    ap.add_argument("--y-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="dtype of y, the LoRA variants' output (float32: a delta buffer, the default so far; "
                         "bfloat16: the engine's form, the Pallas expand adding into the bf16 projection output); "
                         "y's bytes follow it")
    ap.add_argument("--lora-variants", default=None,
                    help=f"comma list of LoRA variants to time besides xla_ref (default all: {','.join(VARIANTS)})")
    ap.add_argument("--read-floor", action="store_true",
                    help="also time bench/read_floor.py on each LoRA case's rows: gathering them and nothing else, "
                         "in one launch and in two (JSON \"read_floor\"; the targets line's floor)")
    args = ap.parse_args()
    try:
        SETTINGS.update(kernel_settings(args.lora_blocks))
    except (ValueError, TypeError) as e:
        raise SystemExit(f"--lora-blocks: {e}") from None
    o = dict(QUICK if args.quick else FULL)
    o["tokens"] = _ints(args.tokens, o["tokens"])
    o["adapters"] = _ints(args.adapters, o["adapters"])
    if args.iters is not None:
        o["iters"] = args.iters
    if args.budget_s is not None:
        o["budget_s"] = args.budget_s
    skip = set(filter(None, args.skip.split(",")))
    dev = jax.devices()[0]
    o["quick"] = args.quick
    o["device_time"] = args.device_time
    o["read_floor"] = args.read_floor
    o["y_dtype"] = args.y_dtype
    o["lora_variants"] = [v for v in (args.lora_variants or "").split(",") if v]
    if set(o["lora_variants"]) - set(VARIANTS):
        raise SystemExit(f"--lora-variants: unknown {sorted(set(o['lora_variants']) - set(VARIANTS))}; known {VARIANTS}")
    o["interpret"] = dev.platform == "cpu"
    triton_unavailable = ranksplit.unavailable_reason()
    o["triton"] = triton_unavailable is None
    t_start = time.perf_counter()

    def over_budget() -> bool:
        return o["budget_s"] > 0 and time.perf_counter() - t_start > o["budget_s"]

    result = {"commit": git_commit(), "device": str(dev.device_kind), "platform": dev.platform,
              "jax": jax.__version__, "python": platform.python_version(),
              "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "mode": "quick" if args.quick else "full", "dtype": "bfloat16",
              "interpret": o["interpret"],
              "triton_unavailable": triton_unavailable,
              "ranksplit_block": dataclasses.asdict(SETTINGS["ranksplit"]),
              "config": {k: v for k, v in o.items() if k not in ("quick",)},
              "tolerance": TOL, "l2_bytes": L2_BYTES, "rotate_bytes": ROTATE_BYTES,
              "lora_block": {"shrink": dataclasses.asdict(SETTINGS["shrink"]),
                             "expand": dataclasses.asdict(SETTINGS["expand"]), "block_t": lora_kernels.BLOCK_T,
                             "shrink_block_t": 1 if lora_kernels.gemv_shrink(o["width"], o["hidden"],
                                                                             SETTINGS["shrink"]) else lora_kernels.BLOCK_T},
              "lora": [], "attention": [], "lora_skipped": [], "attention_skipped": []}

    def save():
        result["elapsed_s"] = time.perf_counter() - t_start
        result["targets"] = targets(result, o)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2))

    bw = copy_bandwidth(o["copy_bytes"], o["copy_iters"])
    result["copy_bandwidth_GBps"] = bw / 1e9
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s on {dev.device_kind} ({dev.platform}), "
          f"interpret={o['interpret']}", flush=True)
    if triton_unavailable:
        print(f"triton column n/a: {triton_unavailable}", flush=True)

    if "attention" not in skip:
        seed = 10
        for model, nh, kvh, d in o["attn_models"]:
            for ps in o["page_sizes"]:
                seed += 1
                if over_budget():
                    result["attention_skipped"].append(f"{model} ps={ps}")
                    continue
                t0 = time.perf_counter()
                c = bench_attention_case(model, nh, kvh, d, ps, bw, o, seed)
                result["attention"].append(c)
                save()
                p, r = c["variants"]["pallas"], c["variants"]["reference"]
                print(f"attention {model:<10} ps={ps:<3} pallas {_cell(p)} reference {_cell(r)} "
                      f"({time.perf_counter() - t0:.1f} s)", flush=True)

    if "lora" not in skip:
        h, i = o["hidden"], o["inter"]
        shapes = {"qkvo": (h, h), "gate_up": (h, i), "down": (i, h)}
        mods = [m for m in args.modules.split(",") if m]
        pools = {m: LoraPool(m, *shapes[m], o, seed=100 + k) for k, m in enumerate(mods)}
        result["lora_pools"] = {m: {"rows": p.n_rows, "width": p.width, "adapters": len(p.ranks),
                                    "MB": p.n_rows * p.width * 2 / 1e6} for m, p in pools.items()}
        seed = 1000
        for t in o["tokens"]:
            for n in o["adapters"]:
                if n > t:  # every adapter needs a token of its own
                    continue
                for m in mods:
                    seed += 1
                    if over_budget():
                        result["lora_skipped"].append(f"{m} T={t} n={n}")
                        continue
                    t0 = time.perf_counter()
                    c = bench_lora_case(pools[m], t, n, bw, o, seed)
                    result["lora"].append(c)
                    save()
                    v = c["variants"]
                    print(f"lora {m:<8} T={t:<4} n={n:<3} " +
                          " ".join(f"{LABELS[k]} {_cell(v[k]).strip()}" for k in VARIANTS[:4]) +
                          f" ({time.perf_counter() - t0:.1f} s)", flush=True)
                    if any((v[k] or {}).get("device") for k in VARIANTS):  # pallas itself may be left out
                        copy = (c.get("same_bytes_copy") or {}).get("device") or {}
                        print("     device time a call: " + ", ".join(
                            f"{name} {d['busy_us']:.1f} us busy ({d['kernels']:.1f} kernels, "
                            f"{_pct(d.get('frac_copy'))})" for name, d in
                            [(LABELS[k], v[k]["device"]) for k in VARIANTS if (v[k] or {}).get("device", {}).get("kernels")] +
                            ([("copy", copy)] if copy.get("kernels") else [])), flush=True)
                        for k in OURS:
                            if (v[k] or {}).get("device"):
                                print(f"     {k} kernels (us a call): " + ", ".join(
                                    f"{name[:40]} {us:.1f}" for name, us in v[k]["device"].get("by_kernel_us", {}).items()),
                                    flush=True)
                    if c.get("read_floor"):
                        print("     read floor: " + ", ".join(
                            f"{form.replace('_', ' ')} {_floor_cell(c['read_floor'][form])}"
                            for form in FLOOR_FORMS), flush=True)
        del pools
    save()
    print(table(result), flush=True)
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
