"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's meaning): for every prompt position
after the first, the logprob of the prompt token there given the tokens before it, its rank in the
vocabulary, and the k most likely tokens' logprobs.

They are computed in the prefill steps that run the prompt, in a variant of the step that only a
batch with such a request runs (`StepInputs.prompt_logprobs`; None: the plain step). The host
picks the step's tokens whose next token is a prompt token of a request that asks (`scored`) and
gives their targets: a chunk's last token targets the first token of the prompt's next chunk,
since the host holds the whole prompt. After the step, `deliver` files the rows into each
RequestOutput. Positions are filed once: a preempted request that prefills its prompt again
computes them again, and they are skipped.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from slora_jax.model import llama as model
from slora_jax.model.config import ModelConfig

BLOCK = 256  # scored tokens whose logits are formed at once


@flax.struct.dataclass
class PromptLogprobInputs:
    """token_idx [R]: the step's tokens that are scored (padding: 0); targets [R]: the prompt
    token that follows each (-1: padding); top: k of the top-k returned (static, 0: none)."""
    token_idx: jax.Array
    targets: jax.Array
    top: int = flax.struct.field(pytree_node=False, default=0)


def score(params, cfg: ModelConfig, h: jax.Array, inp: PromptLogprobInputs) -> jax.Array:
    """[R, 2 + 2k] float32 from the final-normed hidden rows h [T, H]: per scored token its
    target's logprob (log_softmax over the whole vocabulary) and rank (1: the most likely), then
    the top k ids (exact: ids < 2**24) and their logprobs, best first. The logits are formed
    BLOCK tokens at a time, so the step holds BLOCK x vocab float32 of them (128 MiB at a 128k
    vocabulary), never R x vocab."""
    rows, targets = h[inp.token_idx], inp.targets
    r, k = rows.shape[0], inp.top
    b = min(r, BLOCK)  # r is a power of two >= 16, so b divides it

    def block(args):
        x, tgt = args
        lp = jax.nn.log_softmax(model.lm_logits(params, cfg, x), axis=-1)
        t = jnp.take_along_axis(lp, jnp.maximum(tgt, 0)[:, None], axis=-1)
        rank = 1 + jnp.sum(lp > t, axis=-1, keepdims=True)
        parts = [t, rank.astype(jnp.float32)]
        if k:
            top_lp, top_ids = jax.lax.top_k(lp, k)
            parts += [top_ids.astype(jnp.float32), top_lp]
        return jnp.concatenate(parts, axis=-1)

    out = jax.lax.map(block, (rows.reshape(r // b, b, -1), targets.reshape(r // b, b)))
    return out.reshape(r, -1)


# ---------------------------------------------------------------------------------------------
# host


def wanted(req) -> bool:
    return req.params.prompt_logprobs is not None


def scored(chunks) -> list[tuple[object, int, int]]:
    """(request, step token index, prompt position of its target) for each token of a step over
    `chunks` (in packing order) whose next token is a prompt token of a request that asks."""
    out, at = [], 0
    for req, start, end in chunks:
        if wanted(req):
            out += [(req, at + p - start, p + 1) for p in range(start, min(end, req.prompt_len - 1))]
        at += end - start
    return out


def prompt_inputs(chunks, bucket) -> PromptLogprobInputs | None:
    """The PromptLogprobInputs of a prefill step over `chunks`, or None when no request asks (or
    none has a scored token here). bucket(n, lo): the step's power-of-two bucketing; R is
    bucket(scored tokens, 16) and k bucket(largest k, 4), or 0."""
    rows = scored(chunks)
    if not rows:
        return None
    r = bucket(len(rows), 16)
    token_idx, targets = np.zeros(r, np.int32), np.full(r, -1, np.int32)
    token_idx[:len(rows)] = [t for _, t, _ in rows]
    targets[:len(rows)] = [req.tokens[q] for req, _, q in rows]
    k = max(req.params.prompt_logprobs for req, _, _ in rows)
    return PromptLogprobInputs(token_idx, targets, bucket(k, 4) if k else 0)


def deliver(chunks, results: np.ndarray) -> list:
    """File a step's rows (score's output, on the host) into RequestOutput.prompt_logprobs (per
    position {token id: logprob} of the top k and the prompt token) and prompt_ranks (the prompt
    token's rank), each position once. Returns the requests whose logprob at some position is not
    finite (their logits hold NaN or infinity: an adapter whose activations overflow); nothing of
    those rows is filed."""
    rows = scored(chunks)
    if not rows:
        return []
    k_max = (results.shape[1] - 2) // 2
    bad = []
    for (req, _, q), row in zip(rows, results[:len(rows)].tolist()):
        out = req.out
        if out.finished or q != len(out.prompt_logprobs) or req in bad:
            continue  # aborted, filed before a preemption, or failed
        if not math.isfinite(row[0]):
            bad.append(req)
            continue
        k = req.params.prompt_logprobs
        entry = {int(t): lp for t, lp in zip(row[2:2 + k], row[2 + k_max:2 + k_max + k])}
        entry.setdefault(req.tokens[q], row[0])
        out.prompt_logprobs.append(entry)
        out.prompt_ranks.append(int(row[1]))
    return bad
