"""The public Python API: `LLM(model, adapters=..., dtype=...)`, `generate` and `chat`, called as
vLLM's are (`lora_request=LoRARequest(...)`, results in `RequestOutput.outputs`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import jax
import numpy as np

from slora_jax.config import EngineConfig
from slora_jax.engine.adapter_store import AdapterStore, host_cache_bytes
from slora_jax.engine.engine import Engine
from slora_jax.lora import whole_rows_layout
from slora_jax.model import quant, tp
from slora_jax.model.config import load_model_config
from slora_jax.model.tokenizer import load_tokenizer
from slora_jax.model.weights import load_params
from slora_jax.request import LoRARequest, RequestOutput
from slora_jax.sampling import SamplingParams

DTYPES = ("bfloat16", "float16", "float32")


class LLM:
    """One base model, many LoRA adapters, mixed freely in one batch.

    model: a Hugging Face Llama directory (config.json + safetensors) or a shape name from
    configs/models ("tiny", "llama-7b", ...), which gets dummy weights from `seed`.
    adapters: {name: PEFT adapter directory}.
    quantization: None, or "int8": the projections' weights in int8 with per-row scales
    (slora_jax.model.quant; half their bytes, the memory going to the page pool).
    config: an EngineConfig; fields: EngineConfig fields that replace config's (page_size,
    pool_pages, max_num_seqs, max_lora_rank, lora_backend, ...).
    """

    def __init__(self, model: str | os.PathLike, adapters: dict[str, str] | None = None,
                 dtype: str = "bfloat16", *, seed: int = 0, max_model_len: int | None = None,
                 cache_dir: str | None = None, quantization: str | None = None,
                 config: EngineConfig | None = None, **fields):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if quantization is not None and quantization not in quant.QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {quant.QUANTIZATIONS} or None, got {quantization!r}")
        self.model = str(model)
        self.dtype = dtype
        self.cfg = load_model_config(model)
        unknown = sorted(set(fields) - set(EngineConfig.field_names()))
        if unknown:
            raise ValueError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                             f"EngineConfig fields are: {', '.join(EngineConfig.field_names())}")
        self.config = (config or EngineConfig()).replace(**fields)
        self.max_model_len = max_model_len or self.cfg.context_limit
        window = self.cfg.sliding_window
        if window is not None and self.max_model_len > window:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's sliding_window={window}: "
                             f"sliding-window attention is not implemented, and full attention equals it only "
                             f"while a sequence fits the window, so sequences are kept to {window} tokens")
        self.quantization = quantization
        self.params = quant.quantize_params(load_params(model, self.cfg, dtype, seed=seed, cache_dir=cache_dir),
                                            quantization)
        c = self.config
        if c.tensor_parallel_size > 1:  # split now: the whole copy is freed before the pool is sized
            self.params = tp.shard_params(self.params, tp.TP.make(c.tensor_parallel_size, self.cfg))
        self.tokenizer = load_tokenizer(model) if isinstance(model, (str, os.PathLike)) and Path(model).is_dir() else None
        self._rng = np.random.default_rng(seed)
        padded = c.baseline is not None and c.baseline.kind == "padded_slots"
        self.store = AdapterStore(self.cfg, self.params["norm"].dtype, c.page_size, c.max_lora_rank, c.max_cpu_loras,
                                  pad_to_max_rank=padded, host_cache_bytes=host_cache_bytes(c.max_cpu_lora_gb),
                                  tp=c.tensor_parallel_size,
                                  whole_rows=whole_rows_layout(c.lora_backend, jax.default_backend()))
        self.engine = Engine(self.cfg, self.params, dtype, self.store, c, self.max_model_len)
        if adapters:
            self.load_adapters(adapters)

    def warmup(self, max_context: int | None = None, progress: bool = True, lora: bool = True,
               workers: int | None = None) -> int:
        """Compile the step buckets now, with a progress bar: the base model's and, with `lora`,
        those of batches of the registered adapters, `workers` at a time (see Engine.warmup)."""
        return self.engine.warmup(max_context or self.max_model_len, progress, lora, workers)

    # -- adapters ------------------------------------------------------------------------------

    def load_adapter(self, name: str, path: str | os.PathLike) -> None:
        """Register (or replace) adapter `name`; fails whole, leaving the served set unchanged."""
        self.load_adapters({name: path}, workers=1)

    def load_adapters(self, adapters: dict[str, str | os.PathLike], workers: int | None = None) -> None:
        """load_adapter for {name: directory}, files read `workers` at a time (default: up to 8);
        all or nothing: the first failing adapter's error is raised and none is registered."""
        for name in adapters:
            if not isinstance(name, str) or not name:
                raise ValueError(f"adapter name must be a non-empty string, got {name!r}")
        old = {name: self.store.entries[name] for name in adapters if name in self.store.entries}
        self.store.register_many(dict(adapters), workers)  # validates; raises before anything changes
        for entry in old.values():
            self.engine.pool.drop_adapter(entry.key)  # running requests keep the version they started on

    def unload_adapter(self, name: str) -> None:
        if name not in self.store:
            raise KeyError(f"adapter {name!r} is not registered")
        if name in self.engine.busy_adapters():
            raise RuntimeError(f"adapter {name!r} has requests in flight; unload it once they finish")
        self.engine.pool.drop_adapter(self.store.unregister(name).key)

    @property
    def adapters(self) -> list[str]:
        return sorted(self.store.entries)

    def adapter_status(self) -> list[dict]:
        """Per registered adapter: version, path, ranks by module, pages, whether it is resident in
        the device pool and cached in host memory, and its running and waiting requests."""
        return self.engine.adapter_status()

    # -- generation ----------------------------------------------------------------------------

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]] | str,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 adapter: str | None | Sequence[str | None] = None, *,
                 lora_request: LoRARequest | None | Sequence[LoRARequest | None] = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, as vLLM's: with SamplingParams.n > 1 its `outputs` holds
        the n completions (completion j sampled with seed + j when a seed is given).
        lora_request: vLLM's way to name an adapter (registered here on first use); adapter: a
        registered adapter's name. Give one of the two."""
        if lora_request is not None:
            if adapter is not None:
                raise ValueError("give adapter= or lora_request=, not both")
            adapter = self._adapters_of(lora_request)
        texts = [prompts] if isinstance(prompts, str) else \
            [p if isinstance(p, str) else None for p in prompts] if prompts and not \
            isinstance(prompts[0], (int, np.integer)) else [None]
        token_prompts, adapters = self._prepare(prompts, adapter)
        params = self._per_row(sampling_params or SamplingParams(), len(token_prompts), "sampling_params")
        loras = self._per_row(lora_request, len(token_prompts), "lora_request")
        for toks, p in zip(token_prompts, params):
            if len(toks) + p.max_tokens > self.max_model_len:
                raise ValueError(f"prompt of {len(toks)} tokens + max_tokens={p.max_tokens} exceeds "
                                 f"max_model_len={self.max_model_len}")
        rows = [(t, p, a, text, lr, (p.seed + i) if p.seed is not None else int(self._rng.integers(2**31)))
                for t, p, a, text, lr in zip(token_prompts, params, adapters, texts, loras) for i in range(p.n)]
        outs = []
        try:
            for t, p, a, text, lr, seed in rows:
                out = self.engine.add_request(t, p, a, seed, self.cfg.eos_token_ids)
                out.prompt, out.lora_request = text, lr
                outs.append(out)
        except ValueError:
            for out in outs:  # all or nothing
                self.engine.abort(out.request_id)
            raise
        pending = [(out, row[1]) for out, row in zip(outs, rows) if row[1].stop and self.tokenizer is not None]
        while self.engine.has_unfinished():
            self.engine.step()
            pending = [(o, p) for o, p in pending if not self._stop_string(o, p)]
        for out, (_, p, *_rest) in zip(outs, rows):
            if out.stop_reason is None and out.finish_reason == "stop" and out.token_ids \
                    and out.token_ids[-1] in (p.stop_token_ids or ()):
                out.stop_reason = out.token_ids[-1]
            if self.tokenizer is not None and not isinstance(out.stop_reason, str):
                shown = out.token_ids[:-1] if out.finish_reason == "stop" else out.token_ids
                out.text = self.tokenizer.decode(shown, p.skip_special_tokens)
        firsts, k = [], 0
        for p in params:
            outs[k].siblings = outs[k + 1:k + p.n]
            firsts.append(outs[k])
            k += p.n
        return firsts

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             lora_request: LoRARequest | None | Sequence[LoRARequest | None] = None,
             adapter: str | None | Sequence[str | None] = None,
             chat_template: str | None = None) -> list[RequestOutput]:
        """generate() on conversations: each a list of {"role", "content"} messages, rendered with
        the model's chat template (or `chat_template`, a jinja source) as the server renders them."""
        from slora_jax.serve.chat import ChatFormatter
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer.json in the model directory")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        for conv in convs:
            if not conv or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                   and isinstance(m.get("content"), str) for m in conv):
                raise ValueError("each conversation must be a non-empty list of "
                                 "{'role': str, 'content': str} messages")
        fmt = ChatFormatter(self.model, self.tokenizer, chat_template)
        return self.generate([fmt.encode(list(conv)) for conv in convs], sampling_params, adapter,
                             lora_request=lora_request)

    def _stop_string(self, out: RequestOutput, p: SamplingParams) -> bool:
        """Whether `out` is done as far as stop strings go; ends it at the first one found."""
        if out.finished:
            return True
        if len(out.token_ids) < p.min_tokens:  # as vLLM: no stop string ends the text before min_tokens
            return False
        text = self.tokenizer.decode(out.token_ids, p.skip_special_tokens)
        floor = len(self.tokenizer.decode(out.token_ids[:p.min_tokens - 1], p.skip_special_tokens)) \
            if p.min_tokens > 1 else 0  # a stop string must end past the first min_tokens - 1 tokens' text
        hits = [(i, s) for s in p.stop if (i := text.find(s, max(0, floor - len(s) + 1))) >= 0]
        if not hits:
            return False
        i, hit = min(hits)
        self.engine.abort(out.request_id, "stop string")
        out.finish_reason, out.abort_reason, out.stop_reason = "stop", None, hit
        out.text = text[:i + len(hit)] if p.include_stop_str_in_output else text[:i]
        return True

    def _adapters_of(self, lora_request) -> list[str | None] | str | None:
        """Adapter names for LoRARequests, registering each on its first use (or when its path
        changes)."""
        reqs = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request]
        new = {}
        for lr in reqs:
            if lr is None:
                continue
            if not isinstance(lr, LoRARequest):
                raise ValueError(f"lora_request must be a LoRARequest or None, got {type(lr).__name__}")
            entry = self.store.entries.get(lr.lora_name)
            if entry is None or (lr.lora_path and Path(entry.path).resolve() != Path(lr.lora_path).resolve()):
                if not lr.lora_path:
                    raise ValueError(f"adapter {lr.lora_name!r} is not registered and its LoRARequest has no lora_path")
                if new.get(lr.lora_name, lr.lora_path) != lr.lora_path:
                    raise ValueError(f"adapter {lr.lora_name!r} is given two paths in one call")
                new[lr.lora_name] = lr.lora_path
        if new:
            self.load_adapters(new)
        names = [lr.lora_name if lr is not None else None for lr in reqs]
        return names if isinstance(lora_request, (list, tuple)) else names[0]

    def prompt_logits(self, prompts, adapter=None) -> list[np.ndarray]:
        """Logits [T_i, vocab] (float32) at every prompt position, all rows in one mixed batch."""
        token_prompts, adapters = self._prepare(prompts, adapter)
        return self.engine.prompt_logits(token_prompts, adapters)

    def stats(self) -> dict:
        return {**self.engine.stats(), "registered_adapters": len(self.store.entries)}

    # -- input checks --------------------------------------------------------------------------

    def _prepare(self, prompts, adapter):
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        if not prompts:
            raise ValueError("prompts is empty")
        token_prompts = [self._tokenize(p) for p in prompts]
        names = self._per_row(adapter, len(token_prompts), "adapter")
        for n in names:
            if n is not None and n not in self.store:
                raise ValueError(f"unknown adapter {n!r}; registered: {self.adapters}")
        return token_prompts, names

    def _tokenize(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer.json in the model directory; "
                                 "pass token ids instead")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("empty prompt")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.cfg.vocab_size}): {bad[:5]}")
        return ids

    @staticmethod
    def _per_row(value, n: int, what: str) -> list:
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValueError(f"{what} has {len(value)} entries for {n} prompts")
            return list(value)
        return [value] * n
