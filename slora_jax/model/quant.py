"""Weight-only int8 for the base model's projections: half the weights' bytes on the device.

`quantize_params` turns each decoder layer's seven projection weights W [out, in] into int8 with
one float32 scale per output row (symmetric: s = max |W[o, :]| / 127, q = round(W / s)); the
scale sits beside the weight as `<module>_scale`, as a bias sits as `<module>_bias`. The model
multiplies x by the int8 matrix cast to the compute dtype and scales the product's columns
(`llama.linear_q`), so the adapters, which read x and add to the product, are unchanged. The
embedding, the head and the norms stay in the model's dtype.

Freed memory goes to the page pool (it is sized from what is left after the weights), i.e. to
resident adapters and K/V.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from slora_jax.model.config import TARGET_MODULES, scale_key

QUANTIZATIONS = ("int8",)


@jax.jit
def quantize_weight(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(q int8 [out, in], s float32 [out]) with w ~= q * s[:, None]; |q * s - w| <= s / 2."""
    amax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=1)
    s = jnp.where(amax > 0, amax / 127.0, 1.0)  # an all-zero row: scale 1, zeros
    q = jnp.clip(jnp.round(w.astype(jnp.float32) / s[:, None]), -127, 127).astype(jnp.int8)
    return q, s


def dequantize_weight(q: jax.Array, s: jax.Array, dtype) -> jax.Array:
    return (q.astype(jnp.float32) * s[:, None]).astype(dtype)


def quantize_params(params: dict, mode: str | None) -> dict:
    """params with every layer's projections quantized (mode "int8"); mode None: params unchanged.
    Consumes params: each layer's dict is emptied once its quantized copy exists, so the device
    holds one layer's two copies at most (the caller must not use params afterwards)."""
    if mode is None:
        return params
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {mode!r}")
    layers = []
    for layer in params["layers"]:
        new = dict(layer)
        for m in TARGET_MODULES:
            q, s = quantize_weight(layer[m])
            new[m], new[scale_key(m)] = q, s
        layers.append(new)
        layer.clear()  # the caller's dict too: its full-precision weights can be freed now
    return {**params, "layers": layers}
