"""The reference path: a dense KV cache and unmerged LoRA over stacked, rank-padded adapters.

No paging and no kernels. It is slow on purpose: it is the engine's correctness oracle, checked
against transformers + peft, and every faster path is checked against it.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from slora_jax.model import llama as model
from slora_jax.model.config import TARGET_MODULES, ModelConfig
from slora_jax.sampling import sample

# ---------------------------------------------------------------------------------------------
# LoRA: y += scale_i * (x @ A_i) @ B_i, i the row's adapter slot (-1: base, no delta).


def stack_adapters(adapters: Sequence, cfg: ModelConfig, dtype) -> dict:
    """Stack `adapters` (LoraAdapter, in slot order) per module: A [L, S, in, R], B [L, S, R, out],
    scale [L, S]; R is the largest rank of that module, absent (layer, module) pairs are zeros."""
    stacked = {}
    n_layers, n_slots = cfg.num_hidden_layers, len(adapters)
    for module in TARGET_MODULES:
        ranks = [w.rank for ad in adapters for (layer, mod), w in ad.weights.items() if mod == module]
        if not ranks:
            continue
        r = max(ranks)
        fin, fout = cfg.module_shape(module)
        a = np.zeros((n_layers, n_slots, fin, r), np.float32)
        b = np.zeros((n_layers, n_slots, r, fout), np.float32)
        scale = np.zeros((n_layers, n_slots), np.float32)
        for s, ad in enumerate(adapters):
            for (layer, mod), w in ad.weights.items():
                if mod == module:
                    a[layer, s, :, :w.rank] = w.a
                    b[layer, s, :w.rank, :] = w.b
                    scale[layer, s] = w.scale
        stacked[module] = {"A": jnp.asarray(a, dtype), "B": jnp.asarray(b, dtype), "scale": jnp.asarray(scale)}
    return stacked


def lora_reference(stacked: dict, slots: jax.Array):
    """A `model.LoraApply` over stacked adapters; slots [N] int32, -1 for base rows."""
    def apply(layer: int, module: str, x: jax.Array, y: jax.Array, kv=None):
        if module not in stacked:
            return y
        m = stacked[module]
        # One-hot weighting by the row's scale (zero for base rows) keeps it gather-free and exact.
        w = jax.nn.one_hot(slots, m["scale"].shape[1], dtype=jnp.float32) * m["scale"][layer][None, :]
        xa = jnp.einsum("ni,sir->nsr", x, m["A"][layer], preferred_element_type=jnp.float32)
        xa = (xa * w[:, :, None]).astype(x.dtype)
        return y + jnp.einsum("nsr,sro->no", xa, m["B"][layer], preferred_element_type=jnp.float32).astype(y.dtype)
    return apply


# ---------------------------------------------------------------------------------------------
# Dense KV cache: per layer (k, v) of [B, T_max, kv_heads, head_dim].


def empty_cache(cfg: ModelConfig, batch: int, t_max: int, dtype):
    shape = (batch, t_max, cfg.num_key_value_heads, cfg.head_dim)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_hidden_layers)]


def dense_attend(batch: int, positions: jax.Array):
    """An `model.Attend` for tokens laid out [B, T] (flattened), writing K/V at their positions and
    attending causally over everything the row has written up to each query's position."""
    def attend(layer, q, k, v, cache):
        kc, vc = cache[layer]
        t = q.shape[0] // batch
        pos = positions.reshape(batch, t)
        rows = jnp.arange(batch)[:, None]
        kc = kc.at[rows, pos].set(k.reshape(batch, t, *k.shape[1:]))
        vc = vc.at[rows, pos].set(v.reshape(batch, t, *v.shape[1:]))
        mask = jnp.arange(kc.shape[1])[None, None, :] <= pos[:, :, None]
        o = model.attention_scores_softmax(q.reshape(batch, t, *q.shape[1:]), kc, vc, mask)
        cache = list(cache)
        cache[layer] = (kc, vc)
        return o.reshape(q.shape), cache
    return attend


@functools.partial(jax.jit, static_argnames=("cfg", "all_logits"), donate_argnames=("cache",))
def dense_step(params, cfg: ModelConfig, stacked, cache, tokens, positions, slots, last_index,
               temperature, top_k, top_p, seeds, step, all_logits: bool = False):
    """One prefill or decode step over [B, T] tokens. Samples at `last_index` [B] of each row, with
    row keys from (seed, step) [B] so a seeded request samples alike in any batch."""
    batch, t = tokens.shape
    slots_flat = jnp.repeat(slots, t)
    lora = lora_reference(stacked, slots_flat) if stacked else None
    h, cache = model.forward(params, cfg, tokens.reshape(-1), positions.reshape(-1),
                             dense_attend(batch, positions.reshape(-1)), cache, lora)
    h = h.reshape(batch, t, -1)
    if all_logits:
        return model.lm_logits(params, cfg, h), cache
    logits = model.lm_logits(params, cfg, h[jnp.arange(batch), last_index])
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.PRNGKey(s), n))(seeds, step)
    tokens, logprobs = sample(logits, temperature, top_k, top_p, keys)
    return tokens, logprobs, cache
