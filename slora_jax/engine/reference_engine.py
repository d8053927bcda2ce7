"""Synchronous generation on the reference path (dense KV cache, stacked LoRA)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from slora_jax.model import reference
from slora_jax.model.config import ModelConfig
from slora_jax.request import RequestOutput, new_request_id, stop_ids


def _bucket(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class ReferenceEngine:
    def __init__(self, cfg: ModelConfig, params, dtype: str):
        self.cfg, self.params, self.dtype = cfg, params, jnp.dtype(dtype)

    def _batch(self, prompts, adapters):
        """Pad rows to a power of two and prompts to a multiple of 16, to bound recompiles."""
        distinct = list({id(a): a for a in adapters if a is not None}.values())
        slot_of = {id(a): s for s, a in enumerate(distinct)}
        stacked = reference.stack_adapters(distinct, self.cfg, self.dtype) if distinct else {}
        n = len(prompts)
        b = 1 << (n - 1).bit_length()
        t = _bucket(max(map(len, prompts)), 16)
        tokens = np.zeros((b, t), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = p
        slots = np.full(b, -1, np.int32)
        slots[:n] = [slot_of[id(a)] if a is not None else -1 for a in adapters]
        lengths = np.ones(b, np.int32)
        lengths[:n] = [len(p) for p in prompts]
        positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
        return stacked, tokens, positions, slots, lengths

    def prompt_logits(self, prompts, adapters) -> list[np.ndarray]:
        stacked, tokens, positions, slots, lengths = self._batch(prompts, adapters)
        b, t = tokens.shape
        cache = reference.empty_cache(self.cfg, b, t, self.dtype)
        zeros = np.zeros(b, np.float32)
        logits, _ = reference.dense_step(self.params, self.cfg, stacked, cache, tokens, positions, slots,
                                         lengths - 1, zeros, zeros.astype(np.int32), zeros + 1,
                                         np.zeros(b, np.uint32), np.zeros(b, np.int32), all_logits=True)
        logits = np.asarray(logits)
        return [logits[i, :len(p)] for i, p in enumerate(prompts)]

    def generate(self, prompts, params, seeds, adapters, eos_ids) -> list[RequestOutput]:
        stacked, tokens, positions, slots, lengths = self._batch(prompts, adapters)
        b, t = tokens.shape
        n = len(prompts)
        max_new = max(p.max_tokens for p in params)
        cache = reference.empty_cache(self.cfg, b, t + max_new, self.dtype)

        def col(f, dtype, pad):
            out = np.full(b, pad, dtype)
            out[:n] = [f(p) for p in params]
            return out
        temperature = col(lambda p: p.temperature, np.float32, 0.0)
        top_k = col(lambda p: p.top_k if p.top_k > 0 else 0, np.int32, 0)
        top_p = col(lambda p: p.top_p, np.float32, 1.0)
        seed_arr = np.zeros(b, np.uint32)
        seed_arr[:n] = np.asarray(seeds, np.int64) % (2**32)
        stops = [stop_ids(p, eos_ids) for p in params]
        if any(sp.uses_extras for sp in params):
            raise ValueError("the reference engine samples with temperature, top-k and top-p only")
        outs = [RequestOutput(new_request_id(), list(p), logprobs=[] if sp.wants_logprobs else None)
                for p, sp in zip(prompts, params)]

        step = np.zeros(b, np.int32)
        last = lengths - 1
        for k in range(max_new):
            new, lps, cache = reference.dense_step(self.params, self.cfg, stacked, cache, tokens, positions,
                                                   slots, last, temperature, top_k, top_p, seed_arr, step)
            new, lps = np.asarray(new), np.asarray(lps)
            for i, out in enumerate(outs):
                if out.finished:
                    continue
                tok = int(new[i])
                out.token_ids.append(tok)
                if out.logprobs is not None:
                    out.logprobs.append(float(lps[i]))
                if tok in stops[i]:
                    out.finish_reason = "stop"
                elif len(out.token_ids) >= params[i].max_tokens:
                    out.finish_reason = "length"
            if all(o.finished for o in outs):
                break
            # Next decode step: one token per row at the row's next position.
            tokens = new[:, None].astype(np.int32)
            positions = (lengths + k)[:, None].astype(np.int32)
            last = np.zeros(b, np.int32)
            step = step + 1
        return outs
