"""Toy tasks that make `make demo` legible: a tiny model trained to copy a word, and LoRA adapters
trained on top of it to transform the word instead.

An example is `<s>word=answer</s>` in the demo's byte-level tokenizer: the base model learns
answer = word (on words of mixed case, so it knows the capital letters too), each adapter its own
task (TASKS) on lowercase words. The words are random letter strings, so a model that gets an
unseen word right has learned the rule, not the word. Training is Adam (optax) on mini-batches,
through the jnp model (`slora_jax.model.llama.forward`) with plain causal attention, on the CPU in
seconds. The results are saved as an ordinary Hugging Face model directory and PEFT adapter
directories, which the engine then loads like any other.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from slora_jax.model import llama as model
from slora_jax.model.config import ModelConfig
from slora_jax.model.peft import peft_tensor_key, save_peft_adapter

BASE_TASK = ("copy", lambda w: w)


def _caesar(word: str) -> str:
    return "".join(chr((ord(c) - 97 + 1) % 26 + 97) for c in word)


# adapter name -> what it does to the word
TASKS: dict[str, tuple[str, Callable[[str], str]]] = {
    "uppercase": ("uppercase", str.upper),
    "reverse": ("reverse", lambda w: w[::-1]),
    "caesar": ("shift each letter by one", _caesar),
}
MAX_WORD = 6
TRAIN_RANK = 16  # adapters train at this width, their own rank masked in
BATCH = 32
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def prompt(word: str) -> str:
    return f"{word}="


def random_words(rng: np.random.Generator, n: int) -> list[str]:
    lengths = rng.integers(3, MAX_WORD + 1, n)
    return ["".join(chr(97 + int(c)) for c in rng.integers(0, 26, k)) for k in lengths]


def examples(tokenizer, words: list[str], task: Callable[[str], str], eos: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [N, T] (0-padded) of `<s>word=answer</s>` and a mask [N, T] of the positions whose
    next token is part of the answer (or its end): the loss is taken there only."""
    rows, masks = [], []
    for w in words:
        head = tokenizer.encode(prompt(w)).ids                    # <s> word =
        tail = tokenizer.encode(task(w), add_special_tokens=False).ids + [eos]
        rows.append(head + tail)
        masks.append([0] * (len(head) - 1) + [1] * len(tail))
    t = max(map(len, rows))
    ids = np.zeros((len(rows), t), np.int32)
    mask = np.zeros((len(rows), t - 1), np.float32)
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, :len(r)] = r
        mask[i, :len(m)] = m
    return ids, mask


def lora_apply(lora: dict, scale: float, rank_mask=None):
    """A `model.LoraApply` for one adapter held as {module: (A [L, in, r], B [L, r, out])};
    rank_mask [r] (1s, then 0s) keeps only the first ranks."""
    def apply(layer, module, x, y, kv=None):
        a, b = lora[module]
        xa = x @ a[layer]
        return y + scale * ((xa if rank_mask is None else xa * rank_mask) @ b[layer])
    return apply


def causal_attend(batch: int, t: int):
    """A `model.Attend` over whole sequences [batch, t] (flattened), no cache: training only."""
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))

    def attend(layer, q, k, v, kv):
        def rows(x):
            return x.reshape(batch, t, *x.shape[1:])
        return model.attention_scores_softmax(rows(q), rows(k), rows(v), mask).reshape(q.shape), kv
    return attend


def _logits(params, cfg: ModelConfig, ids, lora=None):
    b, t = ids.shape
    positions = jnp.tile(jnp.arange(t, dtype=jnp.int32), b)
    h, _ = model.forward(params, cfg, ids.reshape(-1), positions, causal_attend(b, t), None, lora)
    return model.lm_logits(params, cfg, h).reshape(b, t, -1)


def _loss(ids, mask, logits):
    logp = jax.nn.log_softmax(logits[:, :-1])
    nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    return (nll * mask).sum() / mask.sum()


@functools.cache
def _updater(cfg: ModelConfig, lora_scale: float | None, steps: int, lr: float):
    """Adam with a cosine decay, and one jitted update of the trainable weights: the whole model
    (lora_scale None) or one adapter over the frozen model. Cached: every adapter reuses the
    compiled update."""
    opt = optax.adam(optax.cosine_decay_schedule(lr, steps, alpha=0.05))

    def loss_of(trainable, frozen, ids, mask):
        if lora_scale is None:
            return _loss(ids, mask, _logits(trainable, cfg, ids))
        params, rank_mask = frozen
        return _loss(ids, mask, _logits(params, cfg, ids, lora_apply(trainable, lora_scale, rank_mask)))

    @jax.jit
    def update(trainable, state, frozen, ids, mask):
        loss, grads = jax.value_and_grad(loss_of)(trainable, frozen, ids, mask)
        updates, state = opt.update(grads, state, trainable)
        return optax.apply_updates(trainable, updates), state, loss
    return opt, update


def _train(cfg, trainable, frozen, lora_scale, data, steps: int, lr: float, seed: int, batch: int = BATCH):
    """`steps` updates on mini-batches drawn from `data` (ids, mask). Returns (trained, last loss)."""
    ids, mask = data
    opt, update = _updater(cfg, lora_scale, steps, lr)
    state = opt.init(trainable)
    rng = np.random.default_rng(seed)
    loss = None
    for _ in range(steps):
        pick = rng.integers(0, len(ids), batch)
        trainable, state, loss = update(trainable, state, frozen, ids[pick], mask[pick])
    return trainable, float(loss)


def train_base(params, cfg: ModelConfig, tokenizer, eos: int, *, steps: int = 600, seed: int = 0):
    """The base model trained to copy words of mixed case: answer = word. Returns (params, loss)."""
    rng = np.random.default_rng(seed)
    words = [w.upper() if k % 3 == 0 else w for k, w in enumerate(random_words(rng, 4096))]
    data = examples(tokenizer, words, BASE_TASK[1], eos)
    return _train(cfg, params, None, None, data, steps, 3e-3, seed)


def train_adapter(params, cfg: ModelConfig, tokenizer, eos: int, task: Callable[[str], str], *, rank: int,
                  steps: int = 300, seed: int = 0) -> tuple[dict, float, float]:
    """LoRA (A, B on every linear module) trained on `task` over the frozen `params`, with PEFT's
    init (B zero) and scale alpha / rank = 2. Every rank up to TRAIN_RANK trains in the same
    compiled update, the ranks past `rank` masked off. Returns (lora, scale, last loss)."""
    if not 1 <= rank <= TRAIN_RANK:
        raise ValueError(f"rank {rank} is outside 1..{TRAIN_RANK}")
    key = jax.random.key(seed)
    lora = {}
    for k, module in enumerate(LORA_MODULES):
        fin, fout = cfg.module_shape(module)
        a = jax.random.normal(jax.random.fold_in(key, k), (cfg.num_hidden_layers, fin, TRAIN_RANK)) / np.sqrt(fin)
        lora[module] = (a, jnp.zeros((cfg.num_hidden_layers, TRAIN_RANK, fout)))
    scale = 2.0
    rank_mask = (jnp.arange(TRAIN_RANK) < rank).astype(jnp.float32)
    data = examples(tokenizer, random_words(np.random.default_rng(seed + 1), 4096), task, eos)
    lora, loss = _train(cfg, lora, (params, rank_mask), scale, data, steps, 1e-2, seed)
    return {m: (a[:, :, :rank], b[:, :rank, :]) for m, (a, b) in lora.items()}, scale, loss


def save_adapter(path: Path, cfg: ModelConfig, lora: dict, scale: float) -> None:
    """Write `lora` as a PEFT adapter directory (lora_A [r, in], lora_B [out, r] per layer)."""
    rank = next(iter(lora.values()))[0].shape[-1]
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None, "r": rank,
              "lora_alpha": scale * rank, "lora_dropout": 0.0, "target_modules": list(LORA_MODULES),
              "bias": "none", "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
              "modules_to_save": None, "init_lora_weights": True, "inference_mode": True}
    tensors = {}
    for module, (a, b) in lora.items():
        for layer in range(cfg.num_hidden_layers):
            tensors[peft_tensor_key(layer, module, "A")] = np.asarray(a[layer]).T.astype(np.float32)
            tensors[peft_tensor_key(layer, module, "B")] = np.asarray(b[layer]).T.astype(np.float32)
    save_peft_adapter(path, config, tensors)


def expected(adapter: str | None, word: str) -> str:
    """What a row for `adapter` (None: the base model) should answer for `word`."""
    return (BASE_TASK if adapter is None else TASKS[adapter])[1](word)
