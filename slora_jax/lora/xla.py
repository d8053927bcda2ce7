"""The "xla" LoRA backend in plain jnp: gather each slot's A and B rows from the pool, one-hot over
slots per token. Correct everywhere; the reference the kernels are checked against, and the fastest
path where a decode step holds few adapters (every token meets every slot at the batch's max rank,
so its cost follows slots x max rank)."""

from __future__ import annotations

import jax.numpy as jnp


def lora_xla(x, pool_layer, a_rows, b_rows, ranks, token_slot, max_rank: int, fin: int, fout: int):
    """The delta [T, fout] float32 of every token under its own slot's adapter."""
    xa = lora_xla_shrink(x, pool_layer, a_rows, ranks, token_slot, max_rank, fin)
    return lora_xla_expand(xa.astype(x.dtype), pool_layer, b_rows, max_rank, fout)


def _slot_matrices(pool_layer, slot_rows, max_rank: int, features: int):
    """[Sa, R, features]: each slot's matrix (A^T or B) read from its rows of the pool."""
    rows = pool_layer.reshape(-1, pool_layer.shape[-1])
    sa = slot_rows.shape[0]
    return rows[slot_rows].reshape(sa, -1)[:, :max_rank * features].reshape(sa, max_rank, features)


def lora_xla_shrink(x, pool_layer, a_rows, ranks, token_slot, max_rank: int, fin: int):
    """x @ A of every token against every slot, kept only at the token's own slot and the slot's
    rank: [T, Sa, R] float32."""
    a = _slot_matrices(pool_layer, a_rows, max_rank, fin)
    sa = a_rows.shape[0]
    live = (jnp.arange(max_rank)[None, :] < ranks[:, None])  # [Sa, R]
    sel = token_slot[:, None] == jnp.arange(sa)[None, :]      # [T, Sa]
    xa = jnp.einsum("ti,sri->tsr", x, a, preferred_element_type=jnp.float32)
    return jnp.where(sel[:, :, None] & live[None], xa, 0.0)


def lora_xla_expand(xa, pool_layer, b_rows, max_rank: int, fout: int):
    """The delta [T, fout] float32 of lora_xla_shrink's xa (in the activations' dtype). A slot's
    rows past its rank are not its own (a reused page can hold anything there, NaN included) and
    meet an xa of zero: non-finite values become zero, since 0 * NaN would reach every token.
    Within its rank an adapter's B is finite (checked when it is registered)."""
    b = _slot_matrices(pool_layer, b_rows, max_rank, fout)
    b = jnp.where(jnp.isfinite(b), b, jnp.zeros((), b.dtype))
    return jnp.einsum("tsr,sro->to", xa, b, preferred_element_type=jnp.float32)
