"""Baselines (b) and (c): Hugging Face transformers + PEFT on the GPU, on the same requests as
`bench/run.py --fixed-batch` (bench.trace.FixedBatch: B prompts of P random tokens, G new tokens,
the rows spread round-robin over `mixed` adapters).

(b) mixed   one `generate(..., adapter_names=[...])` over the whole batch. Rows:
            base (adapters disabled), single (one active adapter, no adapter_names),
            and mixed-K for each K in --mixed (PEFT's mixed-batch path, K distinct adapters).
(c) merged  the same requests grouped by adapter; for each group: merge its adapter into the base
            weights, generate the group as one batch, unmerge. Swap (merge + unmerge) and
            generation are timed apart; tok/s counts both.

    python3 bench/baselines/hf_peft.py --out hf_peft.json                 # GPU: llama-7b shape, bf16
    python3 bench/baselines/hf_peft.py --part merged --out hf_merged.json
    python3 bench/baselines/hf_peft.py --smoke                            # CPU: tiny shape, float32

The model is a LlamaForCausalLM of the configs/models shape with random weights drawn in torch
(normal, std 0.02; norms 1 + 0.1 N(0,1)); LoRA A and B random too (PEFT starts B at zero, which
would make every adapter a no-op). Needs torch, transformers and peft, not JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import signal
import statistics
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if sys.path and Path(sys.path[0]).resolve() == REPO / "bench" / "baselines":
    sys.path[0] = str(REPO)
elif str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.provenance import git_commit  # noqa: E402
from bench.trace import FixedBatch  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
HF_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "rms_norm_eps", "rope_theta", "max_position_embeddings",
             "tie_word_embeddings", "bos_token_id", "eos_token_id", "head_dim", "rope_scaling")


def model_shape(name: str) -> dict:
    """configs/models/<name>.toml over base.toml, as a dict of LlamaConfig fields."""
    d = tomllib.loads((REPO / "configs" / "models" / "base.toml").read_text())
    d.update(tomllib.loads((REPO / "configs" / "models" / f"{name}.toml").read_text()))
    return {k: v for k, v in d.items() if k in HF_FIELDS}


class Bench:
    def __init__(self, args):
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM
        self.torch, self.args = torch, args
        self.dev = torch.device(args.device)
        self.dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
        gen = torch.Generator(device=self.dev).manual_seed(args.seed)
        shape = model_shape(args.model)
        rope = shape.pop("rope_scaling", None)
        if rope:
            shape["rope_scaling"] = rope
        config = LlamaConfig(**shape)
        t = time.perf_counter()
        torch.set_default_dtype(self.dtype)
        with torch.device(self.dev):
            model = LlamaForCausalLM(config).to(self.dtype)
        torch.set_default_dtype(torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen, device=self.dev, dtype=torch.float32))
                else:
                    p.normal_(0.0, 0.02, generator=gen)
        model.eval()
        self.vocab = config.vocab_size
        self.n_adapters = max([*args.mixed, *args.merged_mixed, 1])
        lcfg = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS, lora_dropout=0.0,
                          task_type="CAUSAL_LM")
        self.names = [f"a{i}" for i in range(self.n_adapters)]
        pm = get_peft_model(model, lcfg, adapter_name=self.names[0])
        for name in self.names[1:]:
            pm.add_adapter(name, lcfg)
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "lora_A" in name or "lora_B" in name:
                    p.normal_(0.0, 0.02, generator=gen)
        pm.eval()
        self.model = pm
        self.sync()
        self.setup_s = time.perf_counter() - t
        fb = FixedBatch(args.batch, args.prompt_len, args.gen_len, 0, args.rank, args.seed)
        self.prompts = torch.tensor(fb.prompts(self.vocab), device=self.dev)
        self.fb = fb

    def sync(self):
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize()

    def generate(self, ids, new_tokens: int, adapter_names=None):
        kw = dict(input_ids=ids, attention_mask=self.torch.ones_like(ids), max_new_tokens=new_tokens,
                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        if adapter_names is not None:
            kw["adapter_names"] = adapter_names
        with self.torch.inference_mode():
            out = self.model.generate(**kw)
        self.sync()
        return out[:, ids.shape[1]:]

    def timed(self, ids, adapter_names=None) -> tuple[float, int, object]:
        """The median seconds of `repeats` generations after one untimed generation at the full
        shape, as bench/run.py --fixed-batch times the engine: every configuration, the first
        included, is timed warm."""
        self.generate(ids, self.args.gen_len, adapter_names)  # warm-up at full shape
        times = []
        for _ in range(self.args.repeats):
            t = time.perf_counter()
            out = self.generate(ids, self.args.gen_len, adapter_names)
            times.append(time.perf_counter() - t)
        return float(statistics.median(times)), int(out.numel()), out

    def row_names(self, mixed: int) -> list[str]:
        fb = dataclasses.replace(self.fb, mixed=mixed)
        return [self.names[a] for a in fb.adapter_ids()]

    def mixed(self) -> list[dict]:
        rows = []
        with self.model.disable_adapter():
            sec, n, _ = self.timed(self.prompts)
        rows.append(self._row("base", 0, sec, n))
        self.model.set_adapter(self.names[0])
        sec, n, _ = self.timed(self.prompts)
        rows.append(self._row("single", 1, sec, n))
        for k in self.args.mixed:
            sec, n, _ = self.timed(self.prompts, self.row_names(k))
            rows.append(self._row(f"mixed-{k}", k, sec, n))
        return rows

    def merged(self):
        """(c): one batch per adapter, merged weights, swapped between batches; yields each row as
        it finishes (main saves the JSON after every one)."""
        for k in self.args.merged_mixed:
            names = self.row_names(k)
            groups: dict[str, list[int]] = {}
            for i, a in enumerate(names):
                groups.setdefault(a, []).append(i)
            self.generate(self.prompts[:1], self.args.gen_len)  # warm-up at a batch's full length
            swap = gen = 0.0
            n_tok, outs = 0, {}
            # bf16 merge/unmerge leaves rounding residue in the base weights; harmless for timing.
            for a, rows_of in groups.items():
                t = time.perf_counter()
                self.model.set_adapter(a)
                self.model.merge_adapter([a])
                self.sync()
                t1 = time.perf_counter()
                out = self.generate(self.prompts[rows_of], self.args.gen_len)
                t2 = time.perf_counter()
                self.model.unmerge_adapter()
                self.sync()
                t3 = time.perf_counter()
                swap += (t1 - t) + (t3 - t2)
                gen += t2 - t1
                n_tok += int(out.numel())
                outs[a] = out
            row = self._row(f"merged-{k}", k, swap + gen, n_tok)
            row.update(batches=len(groups), swap_s=swap, generate_s=gen)
            if self.args.check:
                row["merged_matches_unmerged"] = self._check(names, outs, groups)
            yield row

    def _check(self, names, outs, groups) -> bool:
        """Greedy tokens of the merged batches equal the unmerged mixed path's (exact in float32)."""
        ref = self.generate(self.prompts, self.args.gen_len, names)
        return all(bool((ref[rows_of] == outs[a]).all()) for a, rows_of in groups.items())

    def _row(self, what, mixed, sec, n) -> dict:
        r = {"what": what, "mixed_adapters": mixed, "batch": self.args.batch, "prompt_len": self.args.prompt_len,
             "gen_len": self.args.gen_len, "generated_tokens": n, "seconds": sec, "gen_tok_s": n / sec}
        print(f"hf_peft {what:10s} {r['gen_tok_s']:9.1f} tok/s  ({sec:.2f} s)", flush=True)
        return r


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--part", default="mixed", choices=["mixed", "merged", "all"])
    ap.add_argument("--model", default="llama-7b", help="a configs/models shape")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--mixed", default=None, help="(b): distinct adapters per batch (default 1,8,32; --smoke: 1,4)")
    ap.add_argument("--merged-mixed", default=None,
                    help="(c): distinct adapters over the requests (default 1,32; --smoke: 1,4)")
    ap.add_argument("--repeats", type=int, default=3, help="timed generations a configuration (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="(c): compare merged tokens with the unmerged path")
    ap.add_argument("--smoke", action="store_true", help="tiny shape, float32, CPU, small batch: the code path")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.dtype, args.device = "tiny", "float32", "cpu"
        args.batch, args.prompt_len, args.gen_len, args.rank = 4, 8, 4, 4
        args.check, args.repeats = True, 1
    # --smoke keeps lists given explicitly (a test that needs a long merged part passes one)
    args.mixed = [int(x) for x in (args.mixed or ("1,4" if args.smoke else "1,8,32")).split(",") if x]
    args.merged_mixed = [int(x) for x in (args.merged_mixed or ("1,4" if args.smoke else "1,32")).split(",") if x]
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    # A timeout's SIGINT must stop the run between rows with what it saved, also where SIGINT was
    # ignored when Python started (a background job of a non-interactive shell inherits SIG_IGN).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import peft
    import torch
    import transformers
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("hf_peft: no CUDA device; use --smoke (CPU) or --device cpu")
    torch.manual_seed(args.seed)
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    result = {"commit": git_commit(), "device": device, "platform": args.device,
              "command": " ".join([Path(sys.executable).name, "bench/baselines/hf_peft.py", *(argv or sys.argv[1:])]),
              "torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
              "python": platform.python_version(), "kind": "hf_peft", "model": args.model, "dtype": args.dtype,
              "rank": args.rank, "targets": TARGETS}
    b = Bench(args)
    result["setup_s"] = b.setup_s
    result["complete"] = False

    def save():  # after every part and merged row: a run cut short by its timeout keeps what it measured
        if args.out:
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(out.name + ".tmp")
            tmp.write_text(json.dumps(result, indent=1))
            tmp.replace(out)  # a reader never sees half a file
    if args.part in ("mixed", "all"):
        result["mixed"] = b.mixed()
        save()
    if args.part in ("merged", "all"):
        result["merged"] = []
        for row in b.merged():
            result["merged"].append(row)
            save()
    result["complete"] = True
    save()
    return result


if __name__ == "__main__":
    main()
