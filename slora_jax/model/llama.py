"""A functional Llama: RMSNorm, RoPE (llama3 / linear scaling), GQA attention, SwiGLU MLP.

The forward pass is written over a flat run of tokens `[N]` with their positions, so the same
code serves the dense reference (padded [B, T] batches flattened) and the paged engine (packed,
ragged prefill and decode). Two things are passed in as functions:

- `attend(layer, q, k, v, kv) -> (out, kv)`: how attention reads and writes the KV cache;
- `lora(layer, module, x, y, kv) -> y`: adds the low-rank term `scale_i * (x @ A_i) @ B_i` to the
  projection's base output y (a kernel can accumulate into y in place, with no delta buffer); it
  sees the current KV state because in the paged engine the adapters live in the same pool.

Layers are unrolled in Python over per-layer arrays: XLA then schedules each layer's kernels
back to back and the dense decode step runs at the bandwidth roofline on a GPU, which a
`fori_loop` over stacked layers does not reach.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from slora_jax.model.config import ModelConfig, bias_key, scale_key

Params = dict[str, Any]
Attend = Callable[[int, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]
LoraApply = Callable[[int, str, jax.Array, jax.Array, Any], jax.Array]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    # As HF: normalise in float32, cast back, then scale.
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies `[head_dim // 2]`, float32, with llama3 or linear scaling applied."""
    d = cfg.head_dim
    inv = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))))
    inv = inv.astype(np.float32)
    rs = cfg.rope_scaling_dict
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "linear":
        inv = inv / np.float32(rs["factor"])
    elif kind == "llama3":
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(rope_inv_freq(cfg))[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [N, head_dim]
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [N, heads, head_dim]; HF's rotate-half convention."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return x * cos + rotated * sin


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w.T with w in HF's [out, in] layout."""
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))


def linear_q(x: jax.Array, w: jax.Array, scale: jax.Array | None) -> jax.Array:
    """linear for a weight that may be quantized (slora_jax.model.quant: int8 w, float32 row scales):
    x @ w.T with w cast to x's dtype, each output column times its scale."""
    if scale is None:
        return linear(x, w)
    return (linear(x, w.astype(x.dtype)).astype(jnp.float32) * scale).astype(x.dtype)


def _proj(layer_params: Params, i: int, module: str, x: jax.Array, lora: LoraApply | None, kv,
          bias: bool = True) -> jax.Array:
    """x W^T (+ the projection's bias, if it has one and `bias`) + the adapters' delta."""
    y = linear_q(x, layer_params[module], layer_params.get(scale_key(module)))
    if bias:
        y = _add_bias(layer_params, module, y)
    return y if lora is None else lora(i, module, x, y, kv)


def _add_bias(layer_params: Params, module: str, y: jax.Array) -> jax.Array:
    b = layer_params.get(bias_key(module))
    return y if b is None else y + b.astype(y.dtype)


def _same(y: jax.Array) -> jax.Array:
    return y


def decoder_layer(cfg: ModelConfig, p: Params, i: int, x: jax.Array, cos, sin, attend: Attend, kv,
                  lora: LoraApply | None, reduce: Callable[[jax.Array], jax.Array] = _same):
    """reduce: applied to the o and down projections' outputs (tensor parallel: their partial sums
    summed across the devices; cfg then holds one device's heads and MLP columns)."""
    n = x.shape[0]
    h = rms_norm(x, p["input_layernorm"], cfg.rms_norm_eps)
    q = _proj(p, i, "q_proj", h, lora, kv).reshape(n, cfg.num_attention_heads, cfg.head_dim)
    k = _proj(p, i, "k_proj", h, lora, kv).reshape(n, cfg.num_key_value_heads, cfg.head_dim)
    if cfg.qk_norm:  # Qwen3: each head's q and k normed before RoPE
        q, k = rms_norm(q, p["q_norm"], cfg.rms_norm_eps), rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    v = _proj(p, i, "v_proj", h, lora, kv).reshape(n, cfg.num_key_value_heads, cfg.head_dim)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    o, kv = attend(i, q, k, v, kv)
    # o and down: a bias is added after `reduce` (tensor parallel: once, not once a device)
    x = x + _add_bias(p, "o_proj", reduce(_proj(p, i, "o_proj", o.reshape(n, cfg.q_size), lora, kv, bias=False)))
    h = rms_norm(x, p["post_attention_layernorm"], cfg.rms_norm_eps)
    gate = _proj(p, i, "gate_proj", h, lora, kv)
    up = _proj(p, i, "up_proj", h, lora, kv)
    x = x + _add_bias(p, "down_proj", reduce(_proj(p, i, "down_proj", jax.nn.silu(gate) * up, lora, kv, bias=False)))
    return x, kv


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array, attend: Attend, kv,
            lora: LoraApply | None = None, reduce: Callable[[jax.Array], jax.Array] = _same):
    """tokens, positions: [N]. Returns the final-normed hidden states [N, H] and the updated KV state.
    reduce: see decoder_layer."""
    x = params["embed_tokens"][tokens]
    cos, sin = rope_cos_sin(cfg, positions)
    for i, p in enumerate(params["layers"]):
        x, kv = decoder_layer(cfg, p, i, x, cos, sin, attend, kv, lora, reduce)
    return rms_norm(x, params["norm"], cfg.rms_norm_eps), kv


def lm_logits(params: Params, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    w = params["embed_tokens"] if cfg.tie_word_embeddings else params["lm_head"]
    return linear(h, w).astype(jnp.float32)


def attention_scores_softmax(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention of q [B, T, nh, d] over k, v [B, S, kvh, d] with mask [B, T, S].
    Keys a query may not see are left out by `where`, never by a zero weight: a reused pool page
    can hold anything there, and another sequence packed into the same block can hold NaN (an
    adapter whose activations overflow); 0 * NaN would reach the output. So non-finite values of
    v are zeroed for the product, and a query that does attend to one (weight > 0) gets NaN."""
    b, t, nh, d = q.shape
    kvh = k.shape[2]
    finite = jnp.isfinite(v)
    bad_key = ~jnp.all(finite, axis=-1)  # [B, S, kvh]
    v = jnp.where(finite, v, jnp.zeros((), v.dtype))
    qg = q.reshape(b, t, kvh, nh // kvh, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) / np.sqrt(d)
    s = jnp.where(mask[:, None, None, :, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)

    def poison(o):  # only where some value of v is not finite: a pass over p, off the common path
        sees = jnp.any((p > 0) & jnp.transpose(bad_key, (0, 2, 1))[:, :, None, None, :], axis=-1)  # [B, kvh, g, T]
        return jnp.where(jnp.transpose(sees, (0, 3, 1, 2))[..., None], jnp.nan, o)
    o = jax.lax.cond(jnp.any(bad_key), poison, lambda o: o, o)
    return o.reshape(b, t, nh, d).astype(q.dtype)
