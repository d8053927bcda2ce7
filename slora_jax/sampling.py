"""Sampling parameters (host) and the on-device sampler: temperature, top-k and top-p always, and
vLLM's extras (logit_bias, min_tokens, penalties, min_p, top-k logprobs) in a step that carries
SamplingExtras. Each extra is a small jnp function; tests/test_sampling.py holds their numpy
references."""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

MAX_LOGPROBS = 20            # the most top logprobs a request may ask for (vLLM's max_logprobs)
MAX_LOGIT_BIAS = 1024        # the most logit_bias entries a request may carry


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """vLLM's SamplingParams fields, with vLLM's meanings, for those implemented here.

    n: completions per prompt, each sampled with its own seed (seed + i when seed is set).
    stop: strings that end a completion; the text stops before the string unless
    include_stop_str_in_output. Checked on the host after every step (LLM.generate).
    skip_special_tokens: leave special tokens out of `text`.
    logprobs: None or False: none; True or 0: the sampled token's logprob; k in 1..MAX_LOGPROBS:
    also the k most likely tokens' (RequestOutput.top_logprobs), as vLLM's logprobs=k. Logprobs
    are the model's raw distribution's, before penalties, bias and temperature, as vLLM reports them.
    prompt_logprobs: None: none; k in 0..MAX_LOGPROBS: per prompt position after the first, the
    logprob of the prompt token there given the tokens before it and the k most likely tokens'
    (RequestOutput.prompt_logprobs). A request that asks skips the prefix cache (every prompt
    position is computed) and may have max_tokens=0: it ends after its prefill, finish_reason
    "length", with no token generated.
    min_p: drop tokens whose probability (after temperature) is below min_p times the most likely's.
    min_tokens: EOS and stop_token_ids cannot be sampled (and stop strings do not end the text)
    before this many tokens.
    presence_penalty, frequency_penalty: subtracted once / per occurrence for each token already
    generated; repetition_penalty: a token in the prompt or generated has its logit divided by it
    (multiplied when negative). logit_bias: {token id: added to its logit}.
    """
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    logprobs: bool | int | None = False
    ignore_eos: bool = False
    stop: str | tuple[str, ...] | list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    ttft_slo: float | None = None  # seconds; None: the engine default
    min_p: float = 0.0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        pl = self.prompt_logprobs
        if pl is not None and (not isinstance(pl, (int, np.integer)) or isinstance(pl, bool)
                               or not 0 <= pl <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {pl!r}")
        least = 0 if pl is not None else 1  # only a prompt-scoring request may generate nothing
        if not isinstance(self.max_tokens, (int, np.integer)) or isinstance(self.max_tokens, bool) \
                or self.max_tokens < least:
            raise ValueError(f"max_tokens must be an integer >= {least}"
                             f"{'' if least == 0 else ' (0 only with prompt_logprobs)'}, got {self.max_tokens!r}")
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
        self._check_extras()
        object.__setattr__(self, "_extras", bool(self.num_top_logprobs or self.min_p > 0 or self.min_tokens
                                                 or self.penalized or self.logit_bias))

    def _check_extras(self):
        lp = self.logprobs
        if lp is not None and not isinstance(lp, bool) and \
                (not isinstance(lp, (int, np.integer)) or not 0 <= lp <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be a bool or an integer in [0, {MAX_LOGPROBS}], got {lp!r}")
        if not (0.0 <= float(self.min_p) <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.min_tokens, (int, np.integer)) or isinstance(self.min_tokens, bool) \
                or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= float(getattr(self, name)) <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not (0.0 < float(self.repetition_penalty) <= 10.0):
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        if self.logit_bias is not None:
            bias = {int(t): float(v) for t, v in dict(self.logit_bias).items()}
            if len(bias) > MAX_LOGIT_BIAS or any(t < 0 or not -100.0 <= v <= 100.0 for t, v in bias.items()):
                raise ValueError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids >= 0 to biases "
                                 f"in [-100, 100], got {self.logit_bias!r}")
            object.__setattr__(self, "logit_bias", bias or None)

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None and self.logprobs is not False

    @property
    def num_top_logprobs(self) -> int:
        """k of logprobs=k (0 for True: the sampled token's alone)."""
        return 0 if isinstance(self.logprobs, bool) or self.logprobs is None else int(self.logprobs)

    @property
    def uses_extras(self) -> bool:
        """Whether a step with this request needs SamplingExtras (top logprobs, min_p, min_tokens,
        penalties or logit_bias)."""
        return self._extras

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


FED = -2  # a history entry that is the row's input token of this step (still on the device: async scheduling)


@flax.struct.dataclass
class SamplingExtras:
    """A step's per-row arrays for what goes beyond temperature, top-k and top-p. A step carries
    it only when some row of its batch asks for one of these, and each part only when some row
    uses it, so a step whose rows use none compiles to the plain sampler.

    bias_ids/bias_values [S, K]: logit_bias, and -inf on the stop ids of a row still short of
    min_tokens (-1: no entry). min_p [S]. penalties [S, 3]: presence, frequency, repetition;
    history [S, H]: each row's prompt then generated tokens (-1: padding, FED: the row's input
    token of this step); prompt_lens [S]. top_logprobs: k of the top-k logprobs the step returns
    (static: 0 returns none).
    """
    bias_ids: jax.Array | None = None
    bias_values: jax.Array | None = None
    min_p: jax.Array | None = None
    penalties: jax.Array | None = None
    history: jax.Array | None = None
    prompt_lens: jax.Array | None = None
    top_logprobs: int = flax.struct.field(pytree_node=False, default=0)


def apply_logit_bias(logits: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
    """logits [S, V] plus values [S, K] at token ids [S, K] (-1: no entry)."""
    rows = jnp.arange(logits.shape[0])[:, None]
    ids = jnp.where(ids < 0, logits.shape[1], ids)  # out of range: dropped
    return logits.at[rows, ids].add(values, mode="drop")


def apply_penalties(logits: jax.Array, history: jax.Array, prompt_lens: jax.Array, penalties: jax.Array,
                    fed: jax.Array) -> jax.Array:
    """vLLM's penalties: a token seen in the prompt or the output has its logit divided by the
    repetition penalty (multiplied when not positive); then frequency x its count in the output
    and presence x (count > 0) are subtracted. fed [S]: each row's input token of this step,
    which FED entries of history stand for."""
    s, v = logits.shape
    hist = jnp.where(history == FED, fed[:, None], history)
    valid = hist >= 0
    ids = jnp.where(valid, hist, v)
    rows = jnp.arange(s)[:, None]
    output = valid & (jnp.arange(hist.shape[1])[None, :] >= prompt_lens[:, None])
    counts = jnp.zeros((s, v), jnp.float32).at[rows, ids].add(output.astype(jnp.float32), mode="drop")
    seen = jnp.zeros((s, v), bool).at[rows, ids].set(True, mode="drop")
    presence, frequency, repetition = penalties[:, 0:1], penalties[:, 1:2], penalties[:, 2:3]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - frequency * counts - presence * (counts > 0)


def min_p_mask(scaled: jax.Array, min_p: jax.Array) -> jax.Array:
    """Temperature-scaled logits with each token below min_p x the top token's probability at -inf."""
    probs = jax.nn.softmax(scaled, axis=-1)
    keep = probs >= min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where(keep, scaled, -jnp.inf)


def top_logprobs(logits: jax.Array, k: int) -> jax.Array:
    """The k most likely tokens of each row under the raw distribution: [S, 2, k] float32, ids
    (exact: ids < 2**24) then logprobs, best first."""
    lp, ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)
    return jnp.stack([ids.astype(jnp.float32), lp], axis=1)


def process_logits(logits: jax.Array, extras: SamplingExtras, fed: jax.Array | None) -> jax.Array:
    """What vLLM applies before greedy and random sampling alike: logit_bias (and min_tokens),
    then the penalties."""
    if extras.bias_ids is not None:
        logits = apply_logit_bias(logits, extras.bias_ids, extras.bias_values)
    if extras.penalties is not None:
        logits = apply_penalties(logits, extras.history, extras.prompt_lens, extras.penalties, fed)
    return logits


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           keys: jax.Array, extras: SamplingExtras | None = None,
           fed: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Next tokens and their logprobs for rows of float32 logits [B, V].

    temperature [B] (0 = greedy), top_k [B] (0 = all), top_p [B], keys [B, 2] uint32 (one PRNG key
    per row, so a seeded request samples the same tokens whatever batch it lands in).
    The logprob is the chosen token's under the model's raw distribution, as vLLM reports it.
    extras (with fed, each row's input token): bias and penalties before sampling, min_p after
    temperature; None is the plain sampler.
    """
    vocab = logits.shape[-1]
    logprobs_all = jax.nn.log_softmax(logits, axis=-1)
    if extras is not None:
        logits = process_logits(logits, extras, fed)
    greedy = jnp.argmax(logits, axis=-1)

    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    if extras is not None and extras.min_p is not None:
        scaled = min_p_mask(scaled, extras.min_p)
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
