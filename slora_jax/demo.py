"""`make demo`: the main job on the embedded default.

The tiny model gets dummy weights, written out as a Hugging Face directory with a byte-level
tokenizer, and a few dozen generated PEFT adapters of mixed ranks and targets. One mixed batch
(adapters of every rank plus base-model rows) goes through the paged engine over a pool too small
to keep every adapter resident, so adapters are paged in and evicted as the batch runs. First, one
prompt goes to the base model and three adapters in one batch, to show that each adapter changes
the output. Adapters are named with vLLM's `LoRARequest`; results are read from `outputs[0]`.

The model and each adapter are written to a temporary directory and renamed into place
(`build_into`), so a kill during the first start never leaves a cache that later starts trip on.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

RANKS = (4, 8, 16, 32)
TARGETS = (["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj"], "all-linear")


def byte_level_tokenizer(path: Path) -> None:
    """A 256-symbol byte-level tokenizer (ids 3..258; 0 <unk>, 1 <s>, 2 </s>) via `tokenizers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{ch: i + 3 for i, ch in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(path / "tokenizer.json"))


MODEL_FILES = ("config.json", "tokenizer.json", "model.safetensors")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def build_into(path: Path, files: tuple[str, ...], write) -> None:
    """Make directory `path` with `write(tmp)` unless it already holds every one of `files`.

    `write` fills a temporary directory beside `path`, which is then renamed into place, so a
    process killed half-way leaves no half-written `path` behind; one left by an older writer
    (some files missing) is removed and rebuilt."""
    if all((path / f).is_file() for f in files):
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        write(tmp)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prepare(workdir: Path, n_adapters: int, seed: int) -> tuple[Path, dict[str, str]]:
    from slora_jax.model.peft import random_peft_adapter
    from slora_jax.model.config import load_model_config
    from slora_jax.model.weights import dummy_params, save_hf_weights

    cfg = load_model_config("tiny")
    model_dir = workdir / "tiny"

    def write_model(d: Path) -> None:
        save_hf_weights(dummy_params(cfg, "float32", seed=seed), cfg, d)
        byte_level_tokenizer(d)

    build_into(model_dir, MODEL_FILES, write_model)
    adapters = {}
    for i in range(n_adapters):
        name = f"customer-{i:03d}"
        path = workdir / "adapters" / name
        build_into(path, ADAPTER_FILES, lambda d, i=i: random_peft_adapter(
            d, cfg, rank=RANKS[i % len(RANKS)], targets=TARGETS[i % len(TARGETS)], seed=seed + i))
        adapters[name] = str(path)
    return model_dir, adapters


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="slora-jax demo", description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=str(Path.home() / ".cache" / "slora_jax" / "demo"))
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--pool-pages", type=int, default=160)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from slora_jax import LLM, LoRARequest, SamplingParams

    model_dir, adapter_dirs = prepare(Path(args.workdir), args.adapters, args.seed)
    t0 = time.perf_counter()
    llm = LLM(model_dir, adapters=adapter_dirs, dtype="float32", pool_pages=args.pool_pages,
              max_num_seqs=16, max_lora_rank=32)
    t_load = time.perf_counter() - t0
    rng = np.random.default_rng(args.seed)
    names = list(adapter_dirs)
    words = ["hello", "adapter", "paged", "pool", "rank", "serve", "jax", "lora", "batch", "token"]
    prompts, chosen = [], []
    for i in range(args.requests):
        prompts.append(" ".join(rng.choice(words, size=int(rng.integers(2, 12)))))
        chosen.append(None if i % 6 == 0 else names[int(rng.integers(len(names)))])
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    loras = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapter_dirs.items())}

    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, lora_request=[loras[a] if a else None for a in chosen])
    t_gen = time.perf_counter() - t0

    print("one prompt, one batch, a different adapter per row (dummy weights: the tokens are noise;")
    print("what shows is that each adapter turns the same prompt into different tokens)")
    same, picked = prompts[0], [None, *names[:3]]
    for a, o in zip(picked, llm.generate([same] * len(picked), sp,
                                         lora_request=[loras[a] if a else None for a in picked])):
        print(f"  {a or 'base model':>12}  {same!r} -> tokens {o.outputs[0].token_ids[:8]} ...")
    print(f"\nthe mixed batch: {len(outs)} requests over {len({a for a in chosen if a})} adapters, first rows:")
    for p, a, o in list(zip(prompts, chosen, outs))[:4]:
        c = o.outputs[0]
        print(f"  {a or 'base model':>12}  {p!r} -> {len(c.token_ids)} tokens {c.token_ids[:6]} ... ({c.finish_reason})")
    print()
    stats = llm.stats()
    n_tok = sum(len(o.token_ids) for o in outs)
    print("summary")
    print(f"  model            tiny (dummy weights), {llm.cfg.num_hidden_layers} layers, hidden "
          f"{llm.cfg.hidden_size}, GQA {llm.cfg.num_attention_heads}/{llm.cfg.num_key_value_heads}")
    print(f"  adapters         {len(names)} registered, ranks {sorted(set(RANKS))}, "
          f"{len({a for a in chosen if a})} used, {sum(a is None for a in chosen)} base-model requests")
    print(f"  requests         {len(outs)} in one mixed batch, {n_tok} tokens generated")
    print(f"  time             load {t_load:.1f} s, generate {t_gen:.1f} s "
          f"(includes XLA compiles on first run; {jax.default_backend().upper()})")
    print(f"  pool             {stats['total_pages']} pages of {stats['page_size']} tokens, "
          f"{stats['evictions']} adapter evictions, {stats['preempted']} preemptions, "
          f"{stats['steps']} steps")
    print(f"  after the run    {stats['kv_pages']} KV pages, {stats['adapter_pages']} adapter pages "
          f"({stats['resident_adapters']} adapters cached), {stats['free_pages']} free")


if __name__ == "__main__":
    main()
