"""`make demo`: the main job on the embedded default.

First run only (then cached on disk): the tiny model is trained, in seconds on a CPU, to copy a
word (`pool=` -> `pool`), and three LoRA adapters are trained over it to do something else with
the word: uppercase it, reverse it, shift each letter by one (slora_jax.toy_tasks). They are saved
as an ordinary Hugging Face model directory and PEFT adapter directories, and every customer gets
its own copy of one of them, so the pool holds many distinct adapters of mixed ranks.

Then the engine serves them the way it serves any adapters: one batch in which each row names
its own adapter (vLLM's `LoRARequest`) next to base-model rows, so each row visibly does its
adapter's task and the base rows copy; and a larger mixed batch over a pool too small to keep
every adapter resident, so adapters are paged in and evicted as it runs, with every answer checked.

Each directory is written to a temporary name and renamed into place (`build_into`), so a kill
during the first start never leaves a cache that later starts trip on.
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

RANKS = (4, 8, 16, 32)  # of the random adapters `prepare` writes (tests)
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


TRAINED_RANKS = {"uppercase": 4, "reverse": 16, "caesar": 8}
WORDS = ("pool", "jax", "lora", "batch", "serve", "token", "page", "rank")  # none is in the training data


def prepare_trained(workdir: Path, n_customers: int, seed: int) -> tuple[Path, dict[str, str], dict[str, str]]:
    """The trained tiny model and task adapters (trained on the first call), and `n_customers`
    adapter directories, each a copy of one task adapter. Returns (model dir, {customer: dir},
    {customer: task})."""
    from tokenizers import Tokenizer

    from slora_jax import toy_tasks
    from slora_jax.model.config import load_model_config
    from slora_jax.model.weights import dummy_params, load_hf_weights, save_hf_weights

    cfg = load_model_config("tiny")
    eos = cfg.eos_token_ids[0]
    model_dir = workdir / "tiny-copy"

    def write_model(d: Path) -> None:
        byte_level_tokenizer(d)
        t = time.perf_counter()
        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        params, loss = toy_tasks.train_base(dummy_params(cfg, "float32", seed=seed), cfg, tok, eos, seed=seed)
        print(f"trained the tiny model to copy a word: loss {loss:.4f}, {time.perf_counter() - t:.1f} s", flush=True)
        save_hf_weights(params, cfg, d)

    build_into(model_dir, MODEL_FILES, write_model)
    trained: dict = {}  # the model's weights and tokenizer, read once if an adapter is to be trained

    def base():
        if not trained:
            trained["tok"] = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
            trained["params"] = load_hf_weights(model_dir, cfg, "float32")
        return trained["params"], trained["tok"]

    tasks = {}
    for k, (task, (description, fn)) in enumerate(toy_tasks.TASKS.items()):
        def write_adapter(d: Path, fn=fn, task=task, description=description, k=k) -> None:
            t = time.perf_counter()
            params, tok = base()
            lora, scale, loss = toy_tasks.train_adapter(params, cfg, tok, eos, fn, rank=TRAINED_RANKS[task],
                                                        seed=seed + k)
            toy_tasks.save_adapter(d, cfg, lora, scale)
            print(f"trained adapter {task!r} ({description}, rank {TRAINED_RANKS[task]}): loss {loss:.4f}, "
                  f"{time.perf_counter() - t:.1f} s", flush=True)
        tasks[task] = workdir / "tasks" / task
        build_into(tasks[task], ADAPTER_FILES, write_adapter)
    customers, customer_task = {}, {}
    names = list(tasks)
    for i in range(n_customers):
        name, task = f"customer-{i:03d}", names[i % len(names)]
        path = workdir / "customers" / name
        build_into(path, ADAPTER_FILES, lambda d, task=task: shutil.copytree(tasks[task], d, dirs_exist_ok=True))
        customers[name], customer_task[name] = str(path), task
    return model_dir, customers, customer_task


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="slora-jax demo", description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=str(Path.home() / ".cache" / "slora_jax" / "demo"))
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--pool-pages", type=int, default=160)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from slora_jax import LLM, LoRARequest, SamplingParams
    from slora_jax.toy_tasks import TASKS, expected, prompt

    model_dir, adapter_dirs, task_of = prepare_trained(Path(args.workdir), args.adapters, args.seed)
    t0 = time.perf_counter()
    llm = LLM(model_dir, adapters=adapter_dirs, dtype="float32", pool_pages=args.pool_pages,
              max_num_seqs=16, max_lora_rank=32)
    t_load = time.perf_counter() - t0
    names = list(adapter_dirs)
    loras = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapter_dirs.items())}
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)

    def answer(o) -> str:
        return o.outputs[0].text.strip()

    # One batch: each word through the base model and one customer of each task.
    first = {task: next(n for n in names if task_of[n] == task) for task in TASKS}
    rows = [(w, a) for w in WORDS[:3] for a in (None, *first.values())]
    outs = llm.generate([prompt(w) for w, _ in rows], sp, lora_request=[loras[a] if a else None for _, a in rows])
    print("\none batch, each row with its own adapter (the base model copies the word):")
    for (w, a), o in zip(rows, outs):
        want = expected(task_of.get(a), w)
        label = "base model" if a is None else f"{a} ({task_of[a]})"
        print(f"  {label:>26}  {prompt(w)!r:10} -> {answer(o)!r:9} {'ok' if answer(o) == want else f'expected {want!r}'}")

    # A larger mixed batch over a pool too small for every adapter: pages in, evicts, checks all.
    rng = np.random.default_rng(args.seed)
    chosen = [None if i % 6 == 0 else names[int(rng.integers(len(names)))] for i in range(args.requests)]
    words = [WORDS[int(rng.integers(len(WORDS)))] for _ in range(args.requests)]
    t0 = time.perf_counter()
    outs = llm.generate([prompt(w) for w in words], sp, lora_request=[loras[a] if a else None for a in chosen])
    t_gen = time.perf_counter() - t0
    right = sum(answer(o) == expected(task_of.get(a), w) for w, a, o in zip(words, chosen, outs))
    print()
    stats = llm.stats()
    n_tok = sum(len(o.token_ids) for o in outs)
    print("summary")
    print(f"  model            tiny, trained to copy; {llm.cfg.num_hidden_layers} layers, hidden "
          f"{llm.cfg.hidden_size}, GQA {llm.cfg.num_attention_heads}/{llm.cfg.num_key_value_heads}")
    print(f"  adapters         {len(names)} customers, each a copy of one of {len(TASKS)} trained adapters "
          f"(ranks {sorted(set(TRAINED_RANKS.values()))}); {len({a for a in chosen if a})} used")
    print(f"  requests         {len(outs)} in one mixed batch ({sum(a is None for a in chosen)} base model), "
          f"{right}/{len(outs)} answers right, {n_tok} tokens generated")
    print(f"  time             load {t_load:.1f} s, generate {t_gen:.1f} s "
          f"(includes XLA compiles on first run; {jax.default_backend().upper()})")
    print(f"  pool             {stats['total_pages']} pages of {stats['page_size']} tokens, "
          f"{stats['evictions']} adapter evictions, {stats['preempted']} preemptions, "
          f"{stats['steps']} steps")
    print(f"  after the run    {stats['kv_pages']} KV pages, {stats['adapter_pages']} adapter pages "
          f"({stats['resident_adapters']} adapters cached), {stats['free_pages']} free")
    if right != len(outs):
        raise SystemExit(f"{len(outs) - right} of {len(outs)} answers were wrong")


if __name__ == "__main__":
    main()
