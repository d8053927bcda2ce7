"""Tensor parallel against one device, on N host CPU devices (run by tests/test_tp.py in a process
of its own: XLA's device count is fixed when JAX starts).

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python tests/tp_check.py OUT.json [backend ...]

For each LoRA/attention backend ("xla", "pallas": interpret mode), the tiny GQA model serves one
mixed batch (base rows; adapters of ranks 4-16 on attention only and on every module) with
tensor_parallel_size 1 and 2, async scheduling; then, under tensor_parallel_size 2, an adapter registered at
run time, a second batch, and the prompt logits. Writes what it saw as JSON for the test to judge.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from slora_jax import LLM, SamplingParams  # noqa: E402
from slora_jax.model.peft import random_peft_adapter  # noqa: E402
from slora_jax.model.config import load_model_config  # noqa: E402

CFG = load_model_config("tiny")
SP = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, ignore_eos=True)


def main(out: str, backends: list[str]) -> None:
    root = Path(tempfile.mkdtemp(prefix="slora-tp-"))
    specs = {"all8": (8, "all-linear"), "qv4": (4, ["q_proj", "v_proj"]), "all16": (16, "all-linear"),
             "late": (12, ["o_proj", "down_proj", "gate_proj"])}
    paths = {name: random_peft_adapter(root / name, CFG, rank=r, targets=t, seed=i)
             for i, (name, (r, t)) in enumerate(specs.items())}
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, CFG.vocab_size, n)] for n in (5, 9, 3, 12, 7, 1)]
    adapters = ["all8", None, "qv4", "all16", "all8", None]
    result = {"devices": len(jax.devices()), "runs": {}}
    for backend in backends:
        runs = {}
        for tp in (1, 2):
            llm = LLM("tiny", adapters={k: paths[k] for k in ("all8", "qv4", "all16")}, dtype="float32",
                      page_size=16, pool_pages=64, tensor_parallel_size=tp, lora_backend=backend,
                      attention_backend=backend, async_scheduling=True, max_num_seqs=8, max_num_batched_tokens=64)
            run = {}
            if tp > 1:  # the warm-up compiles the split step's shapes: serving then meets no new one
                run["warmup_shapes"] = llm.warmup(max_context=32, progress=False)
                before = set(llm.engine._shapes)
            outs = llm.generate(prompts, SP, adapter=adapters)
            run.update(tokens=[o.token_ids for o in outs], logprobs=[o.logprobs for o in outs])
            if tp > 1:
                run["new_shapes_in_serving"] = len(set(llm.engine._shapes) - before)
            if tp > 1:
                e = llm.engine
                run["shardings"] = {"q_proj": str(e.params["layers"][0]["q_proj"].sharding.spec),
                                    "o_proj": str(e.params["layers"][0]["o_proj"].sharding.spec),
                                    "pool": str(e.kv[0].sharding.spec),
                                    "pool_shard": list(e.kv[0].addressable_shards[0].data.shape),
                                    "pool_global": list(e.kv[0].shape)}
                # at run time: register an adapter, serve it beside the others, score prompts
                llm.load_adapter("late", paths["late"])
                later = llm.generate(prompts[:3], SP, adapter=["late", "qv4", None])
                run["later_tokens"] = [o.token_ids for o in later]
                run["prompt_logits"] = [np.asarray(x).tolist() for x in
                                        e.prompt_logits(prompts[:2], ["late", None])]
                llm.unload_adapter("late")
                st = e.stats()
                run["pages_after"] = {k: st[k] for k in ("total_pages", "free_pages", "kv_pages", "adapter_pages", "prefix_cache")}
            runs[tp] = run
        one = LLM("tiny", adapters={k: paths[k] for k in ("late", "qv4")}, dtype="float32", page_size=16,
                  pool_pages=64, lora_backend=backend, attention_backend=backend)
        runs["one_device_later"] = [o.token_ids for o in one.generate(prompts[:3], SP, adapter=["late", "qv4", None])]
        runs["one_device_prompt_logits"] = [np.asarray(x).tolist() for x in
                                            one.engine.prompt_logits(prompts[:2], ["late", None])]
        result["runs"][backend] = runs
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or ["xla", "pallas"])
