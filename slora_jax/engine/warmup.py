"""Warm-up: compile the step shapes a server meets before the first request, with a progress bar.

A step's shape is its bucket: decode steps at every batch bucket x page-table bucket, prefill
steps at every token bucket x key window (with prefix caching, again with context in the pool at
every context bucket), each again with LoRA at every slot bucket on each module set.
`warmup_shapes` lists them as null inputs; `compile_shapes` compiles them without running them,
before serving, and `compile_in_background` on a thread while the engine serves.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from slora_jax.engine import step as paged
from slora_jax.model import tp as tp_mod
from slora_jax.engine.inputs import pow2
from slora_jax.engine.scheduler import MAX_PREFILL_SEQS


def shape_key(inp: paged.StepInputs) -> tuple:
    """What makes a step compile anew: its kind, its tree and its arrays' shapes."""
    return ("decode" if inp.decode else "prefill", jax.tree_util.tree_structure(inp),
            tuple(np.shape(x) for x in jax.tree_util.tree_leaves(inp)))


def warmup_shapes(engine, max_context: int | None = None, lora: bool = True) -> list[paged.StepInputs]:
    """Null step inputs for the buckets a server meets: decode at every batch bucket (powers of
    two up to max_num_seqs) times every page-table bucket up to max_context tokens (one,
    max_model_len's, under the Pallas kernel), and prefill of fresh prompts up to
    max_num_batched_tokens. With prefix caching, or with max_context over a step's token budget
    (a long prompt's later chunks), every such prefill again with context in the pool at every
    context bucket up to max_context (StepInputBuilder.context_bucket). With `lora` and adapters
    registered, each again with LoRA at every slot bucket on each module set a step can carry.
    Not covered (compiled on first use): steps with sampling extras or prompt logprobs."""
    config, build = engine.config, engine.builder
    ctx = max_context or min(engine.max_model_len, 4096)
    module_sets = engine.slots.module_sets() if lora else []
    floor = build.decode_page_floor
    shapes = []
    s = 1
    while s <= pow2(config.max_num_seqs):
        p = floor
        while p <= max(floor, pow2(engine.kv_pages_for(ctx))):
            shapes.append(build.null(s, s, p, decode=True))
            shapes += [build.null(s, s, p, decode=True, lora=(modules, sa))
                       for modules in module_sets for sa in engine._slot_buckets(s, s, decode=True)]
            p *= 2
        s *= 2
    # Fresh prompts (no context in the pool yet: a one-column page table) packed to n tokens in
    # all run at pow2(n, 16) tokens x the prefill row bucket, with every key window that
    # prompts of up to max_context tokens give.
    s = pow2(MAX_PREFILL_SEQS)
    # Prefill with context in the pool: common under prefix caching; without it, only the later
    # chunks of a prompt longer than a step's budget.
    # Under the prefill kernel every prefill step lists its context (StepInputBuilder), in one bucket.
    with_context = build.prefill_kernel or config.enable_prefix_caching or ctx > config.max_num_batched_tokens
    contexts = sorted({build.context_bucket(p) for p in range(engine.kv_pages_for(ctx) + 1)}) if with_context else []
    for t in sorted({pow2(n, 16) for n in range(1, config.max_num_batched_tokens + 1)}):
        for w in sorted({build.key_window(t, n) for n in range(1, min(t, ctx) + 1)}):
            loras = [None] + [(modules, sa) for modules in module_sets
                              for sa in engine._slot_buckets(min(t, s), t, decode=False)]
            if not build.prefill_kernel:
                shapes += [build.null(t, s, 1, decode=False, lora=lora, key_window=w) for lora in loras]
            shapes += [build.null_context(t, s, k, lora=lora, key_window=w) for k in contexts for lora in loras]
    return shapes


def lower_step(engine, inp: paged.StepInputs, spec):
    """Trace and lower the step of `inp`'s shape, both of its jits (forward_sample and commit_kv),
    without compiling: Python work that holds the interpreter lock. The pool enters as `spec`
    (pool_spec's ShapeDtypeStructs with the pool's shardings), so this is safe on any thread while
    the engine thread steps (and donates) the real pool. Waits first while the engine compiles a
    step on its first use (Engine.compile_gate): a request is waiting for that one."""
    engine.compile_gate.wait()
    if engine.tp is not None:
        lowered = paged.forward_sample_tp.lower(engine.params, spec, inp, cfg=engine.cfg, tp=engine.tp)
    else:
        lowered = paged.forward_sample.lower(engine.params, spec, inp, cfg=engine.cfg)
    # The step's new K/V as commit_kv receives it: committed to the pool's device(s).
    kv_sharding = engine.tp.sharding(tp_mod.KV) if engine.tp is not None else jax.tree.leaves(spec)[0].sharding
    new_kv = jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=kv_sharding), lowered.out_info[0])
    if engine.tp is not None:
        commit = paged.commit_kv_tp.lower(spec, new_kv, inp.kv_slot, tp=engine.tp)
    else:
        commit = paged.commit_kv.lower(spec, new_kv, inp.kv_slot)
    return lowered, commit


def finish_step(engine, inp: paged.StepInputs, lowered) -> str:
    """Compile lower_step's two lowered jits (XLA's work, or a load from the persistent cache). A
    later step of that shape finds both executables in jit's cache. Returns a label for progress
    bars."""
    for low in lowered:
        low.compile()
    engine._shapes.add(shape_key(inp))
    slots = f" lora x{len(inp.lora.seg_starts) - 1}" if inp.lora is not None else ""
    if inp.decode:
        return f"decode {inp.tokens.shape[0]}x{inp.page_table.shape[1]}{slots}"
    context = f" context {inp.ctx_pages.shape[0]}" if inp.prefill_context else ""
    return f"prefill {inp.tokens.shape[0]}{context}{slots}"


def pool_spec(engine):
    """The engine's pool as ShapeDtypeStructs (shape, dtype, sharding): what lower_step lowers on."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), engine.kv)


def first_use_order(shapes: list[paged.StepInputs]) -> list[paged.StepInputs]:
    """Decode and prefill shapes taken in turn, each kind smallest first (tokens x pages read):
    a first request's two steps (a short prompt's prefill, then decode at batch 1) come first."""
    def size(inp):
        return inp.tokens.shape[0] * (inp.page_table.shape[1] if inp.decode else
                                      1 + (inp.ctx_pages.shape[0] if inp.prefill_context else 0))
    kinds = [sorted((inp for inp in shapes if inp.decode == d), key=size) for d in (False, True)]
    return [inp for pair in itertools.zip_longest(*kinds) for inp in pair if inp is not None]


def compile_shapes(engine, shapes: list[paged.StepInputs], progress: bool = True, workers: int | None = None,
                   spec=None) -> int:
    """Compile every shape, in first_use_order, with a progress bar. This thread traces and lowers
    them one after another (lower_step: Python, under the interpreter lock), while `workers`
    threads (default 1) compile the lowered jits side by side (finish_step). So lowering the next
    shape overlaps compiling the last, and on a warm persistent cache, where a compile is a load,
    the engine thread shares the interpreter with one lowering thread rather than with every
    worker. On a GPU, XLA autotunes its GEMMs by timing them on the device, and concurrent
    compiles may time each other's kernels, so one compiling worker is the default. Returns how
    many shapes."""
    spec = spec if spec is not None else pool_spec(engine)
    shapes = first_use_order(shapes)
    bar = tqdm(total=len(shapes), desc="compiling step buckets", unit="shape", disable=not progress)
    with concurrent.futures.ThreadPoolExecutor(max(1, workers or 1)) as pool:
        futures = []
        for inp in shapes:
            lowered = lower_step(engine, inp, spec)
            futures.append(pool.submit(finish_step, engine, inp, lowered))
            futures[-1].add_done_callback(lambda f: f.exception() or (bar.set_postfix_str(f.result()), bar.update()))
        for f in futures:
            f.result()
    bar.close()
    return len(shapes)


def compile_in_background(engine, shapes: list[paged.StepInputs], workers: int | None = None,
                          on_done=None) -> threading.Thread:
    """compile_shapes on a daemon thread, so the engine serves at once: a step whose shape is not
    compiled yet compiles on first use, as without warm-up. `on_done(count, seconds)` runs on that
    thread at the end."""
    spec = pool_spec(engine)  # taken here: the engine thread replaces engine.kv at every step

    def run():
        t = time.perf_counter()
        n = compile_shapes(engine, shapes, progress=False, workers=workers, spec=spec)
        if on_done is not None:
            on_done(n, time.perf_counter() - t)

    thread = threading.Thread(target=run, name="slora-warmup", daemon=True)
    thread.start()
    return thread
