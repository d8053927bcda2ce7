"""Sampling parameters (host) and the on-device sampler."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """vLLM's SamplingParams fields, with vLLM's meanings, for those implemented here.

    n: completions per prompt, each sampled with its own seed (seed + i when seed is set).
    stop: strings that end a completion; the text stops before the string unless
    include_stop_str_in_output. Checked on the host after every step (LLM.generate).
    skip_special_tokens: leave special tokens out of `text`.
    """
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    logprobs: bool = False
    ignore_eos: bool = False
    stop: str | tuple[str, ...] | list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    ttft_slo: float | None = None  # seconds; None: the engine default

    def __post_init__(self):
        if not isinstance(self.max_tokens, (int, np.integer)) or isinstance(self.max_tokens, bool) \
                or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (0.0 <= float(self.temperature) <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not (0.0 < float(self.top_p) <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, (int, np.integer)) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, (int, np.integer)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.n, (int, np.integer)) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")
        if self.stop is not None:
            stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
            if not all(isinstance(x, str) and x for x in stops):
                raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
            object.__setattr__(self, "stop", stops)
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Next tokens and their logprobs for rows of float32 logits [B, V].

    temperature [B] (0 = greedy), top_k [B] (0 = all), top_p [B], keys [B, 2] uint32 (one PRNG key
    per row, so a seeded request samples the same tokens whatever batch it lands in).
    The logprob is the chosen token's under the model's raw distribution, as vLLM reports it.
    """
    vocab = logits.shape[-1]
    logprobs_all = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1)

    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    sorted_logits = -jnp.sort(-scaled, axis=-1)  # descending
    k = jnp.where(top_k <= 0, vocab, jnp.minimum(top_k, vocab))
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    probs_sorted = jax.nn.softmax(sorted_logits, axis=-1)
    # Smallest prefix whose mass reaches top_p: keep a sorted entry if the mass before it is < top_p.
    mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    keep_sorted = mass_before < top_p[:, None]
    n_keep = jnp.maximum(jnp.sum(keep_sorted, axis=-1), 1)
    pth = jnp.take_along_axis(sorted_logits, (n_keep - 1)[:, None], axis=-1)
    threshold = jnp.maximum(kth, pth)
    masked = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    sampled = jax.vmap(jax.random.categorical)(keys, masked)

    tokens = jnp.where(temperature <= 0.0, greedy, sampled).astype(jnp.int32)
    lp = jnp.take_along_axis(logprobs_all, tokens[:, None], axis=-1)[:, 0]
    return tokens, lp
