"""The correctness oracle: Hugging Face transformers + peft, torch on CPU, float32.

Runs in the ORACLE interpreter (torch + transformers + peft), never in the engine's.

    python tests/oracle/run_oracle.py --prompts PROMPTS.json --out OUT_DIR \
        (--manifest MANIFEST.json | --build-fixtures FIXTURE_DIR) [--max-tokens 8]

PROMPTS.json is a list of token-id lists (or {"prompts": [...]}). For every model in the manifest,
for the base model and for every adapter, and for every prompt, it computes:

  logits    [T, V] float32   the logits at every prompt position (one forward, batch of one, no padding)
  tokens    [N]    int64     greedy decoding of N new tokens, EOS ignored (a manual loop of full
                             forwards + argmax; `generate` is not used)
  logprobs  [N]    float32   log_softmax of each step's logits at the chosen token
  margins   [N]    float32   top-1 minus top-2 logit at each greedy step (how clear the choice was)

OUT_DIR/oracle.npz holds them under the keys  f"{model}__{label}__{prompt_index}__{field}",
with label = adapter name, or "__base__" for the base model.  OUT_DIR/index.json describes them
and records the sanity checks (which fail the run when they do not hold):

  - every adapter changes the logits of the base model (otherwise LoRA parity would be vacuous);
  - a PeftModel with its adapters disabled reproduces the plain base model;
  - gqa's llama3 rope scaling changes the logits (so the engine must implement it);
  - each alias (gqa_legacy: a transformers-4 style config.json) reproduces its model exactly;
  - no greedy step is a near tie (top-1 minus top-2 logit > MARGIN_MIN), so parity cannot flake.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# CPU and float32, whatever machine this runs on (the GPU machine's system python has CUDA torch).
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

BASE = "__base__"
ADAPTER_MIN_EFFECT = 0.05   # max |logits(adapter) - logits(base)| over all prompts must exceed this
ROPE_MIN_EFFECT = 1e-2      # gqa: max |logits(llama3 rope) - logits(plain rope)| must exceed this
MARGIN_MIN = 1e-3           # every greedy step: top-1 minus top-2 logit must exceed this, so float32
                            # rounding (~1e-5 here) cannot flip a greedy choice and flake the parity tests


def _load_base(model_dir: str, config=None):
    from transformers import LlamaForCausalLM

    kw = {} if config is None else {"config": config}
    m = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager", **kw)
    return m.to("cpu").eval()


@torch.inference_mode()
def _logits(model, ids: list[int]) -> torch.Tensor:
    out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
    return out.logits[0].to(torch.float32)


@torch.inference_mode()
def run_one(model, prompt: list[int], max_tokens: int) -> dict[str, np.ndarray]:
    """Prompt logits and greedy decoding by full forwards (no KV cache, no generate())."""
    logits = _logits(model, prompt)
    seq = list(prompt)
    last = logits[-1]
    toks, lps, margins = [], [], []
    for step in range(max_tokens):
        if step > 0:
            last = _logits(model, seq)[-1]
        tok = int(torch.argmax(last))
        lp = torch.log_softmax(last.to(torch.float64), dim=-1)[tok]
        top2 = torch.topk(last, 2).values
        toks.append(tok)
        lps.append(float(lp))
        margins.append(float(top2[0] - top2[1]))
        seq.append(tok)
    return {
        "logits": logits.numpy().astype(np.float32),
        "tokens": np.asarray(toks, dtype=np.int64),
        "logprobs": np.asarray(lps, dtype=np.float32),
        "margins": np.asarray(margins, dtype=np.float32),
    }


def _key(model: str, label: str, pi: int, field: str) -> str:
    return f"{model}__{label}__{pi}__{field}"


def run_all(manifest: dict, prompts: list[list[int]], out: Path, max_tokens: int) -> dict:
    from peft import PeftModel

    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(1)  # tiny matmuls: threads only add overhead, and CI has 2 cores
    out.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    checks: dict[str, dict] = {}
    failures: list[str] = []
    index = {
        "base_label": BASE, "max_tokens": max_tokens, "prompts": prompts,
        "models": {}, "adapters": {}, "aliases": manifest.get("aliases", {}), "checks": checks,
        "versions": {"torch": torch.__version__},
    }
    import peft
    import transformers
    index["versions"].update(transformers=transformers.__version__, peft=peft.__version__)

    for model_name, model_dir in manifest["models"].items():
        index["models"][model_name] = model_dir
        adapters = manifest["adapters"].get(model_name, {})
        index["adapters"][model_name] = dict(adapters)
        base = _load_base(model_dir)
        base_res = [run_one(base, p, max_tokens) for p in prompts]
        for pi, r in enumerate(base_res):
            for f, a in r.items():
                arrays[_key(model_name, BASE, pi, f)] = a

        # The rope scaling must matter, or the engine could ignore it and still pass.
        if getattr(base.config, "rope_parameters", None) and \
                base.config.rope_parameters.get("rope_type", "default") != "default":
            from transformers import AutoConfig
            cfg = AutoConfig.from_pretrained(model_dir)
            cfg.rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_parameters["rope_theta"]}
            plain = _load_base(model_dir, config=cfg)
            longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
            d = float((_logits(plain, prompts[longest]) - torch.from_numpy(base_res[longest]["logits"])).abs().max())
            checks[f"{model_name}: rope scaling changes logits"] = {"max_abs_diff": d, "min": ROPE_MIN_EFFECT}
            if not d > ROPE_MIN_EFFECT:
                failures.append(f"{model_name}: rope scaling changes the logits by only {d:g}")
            del plain

        if adapters:
            names = list(adapters)
            pm = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0], is_trainable=False)
            for n in names[1:]:
                pm.load_adapter(adapters[n], adapter_name=n, is_trainable=False)
            pm.eval()
            with pm.disable_adapter():
                d = max(float((_logits(pm, p) - torch.from_numpy(base_res[pi]["logits"])).abs().max())
                        for pi, p in enumerate(prompts))
            checks[f"{model_name}: disabled adapters reproduce base"] = {"max_abs_diff": d}
            if d != 0.0:
                failures.append(f"{model_name}: PeftModel.disable_adapter() differs from base by {d:g}")
            for n in names:
                pm.set_adapter(n)
                effect = 0.0
                for pi, p in enumerate(prompts):
                    r = run_one(pm, p, max_tokens)
                    effect = max(effect, float(np.abs(r["logits"] - base_res[pi]["logits"]).max()))
                    for f, a in r.items():
                        arrays[_key(model_name, n, pi, f)] = a
                checks[f"{model_name}/{n}: adapter changes logits"] = {
                    "max_abs_diff": effect, "min": ADAPTER_MIN_EFFECT}
                if not effect > ADAPTER_MIN_EFFECT:
                    failures.append(f"{model_name}/{n}: adapter changes the logits by only {effect:g}")
            del pm
        del base

    for alias, spec in manifest.get("aliases", {}).items():
        m = _load_base(spec["path"])
        d = max(float(np.abs(_logits(m, p).numpy() - arrays[_key(spec["same_as"], BASE, pi, "logits")]).max())
                for pi, p in enumerate(prompts))
        checks[f"{alias}: reproduces {spec['same_as']}"] = {"max_abs_diff": d}
        if d != 0.0:
            failures.append(f"alias {alias} differs from {spec['same_as']} by {d:g}")
        del m

    margins = [float(a.min()) for k, a in arrays.items() if k.endswith("__margins")]
    index["min_greedy_margin"] = min(margins) if margins else None
    checks["greedy margins"] = {"min": index["min_greedy_margin"], "required": MARGIN_MIN}
    if margins and not min(margins) > MARGIN_MIN:
        failures.append(f"a greedy step is a near tie (margin {min(margins):g} <= {MARGIN_MIN:g}): "
                        "change build_fixtures.SEED or the prompts")
    np.savez(out / "oracle.npz", **arrays)
    index["failures"] = failures
    (out / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    return index


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--manifest", help="manifest.json written by build_fixtures.py")
    g.add_argument("--build-fixtures", metavar="DIR", help="build the fixtures into DIR first, then use them")
    ap.add_argument("--prompts", required=True, help="JSON: list of token-id lists, or {'prompts': [...]}")
    ap.add_argument("--out", required=True, help="output directory (oracle.npz, index.json)")
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    if args.build_fixtures:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import build_fixtures
        manifest = build_fixtures.build_all(args.build_fixtures)
    else:
        manifest = json.loads(Path(args.manifest).read_text())
    t1 = time.perf_counter()
    prompts = json.loads(Path(args.prompts).read_text())
    if isinstance(prompts, dict):
        prompts = prompts["prompts"]
    prompts = [[int(t) for t in p] for p in prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
        ap.error("prompts must be a non-empty list of non-empty token-id lists")
    index = run_all(manifest, prompts, Path(args.out), args.max_tokens)
    t2 = time.perf_counter()
    index["seconds"] = {"build_fixtures": t1 - t0, "oracle": t2 - t1}
    index["manifest"] = manifest
    (Path(args.out) / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    for k, v in index["checks"].items():
        print(f"check  {k}: {v}")
    print(f"min greedy margin: {index['min_greedy_margin']:.4g}")
    print(f"seconds: build {t1 - t0:.1f}, oracle {t2 - t1:.1f}")
    if index["failures"]:
        print("ORACLE SANITY CHECKS FAILED:\n  " + "\n  ".join(index["failures"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
