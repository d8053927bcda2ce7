"""The demo's toy tasks (slora_jax.toy_tasks): the training examples, and an adapter saved in
PEFT's layout that the engine serves exactly as the training forward computes it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer

from slora_jax import LLM, SamplingParams, toy_tasks
from slora_jax.demo import byte_level_tokenizer
from slora_jax.model.config import load_model_config
from slora_jax.model.weights import dummy_params, save_hf_weights

CFG = load_model_config("tiny")
EOS = CFG.eos_token_ids[0]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("toy_tok")
    byte_level_tokenizer(d)
    return d, Tokenizer.from_file(str(d / "tokenizer.json"))


def test_examples_mask_the_answer_and_its_end(tok):
    _, t = tok
    ids, mask = toy_tasks.examples(t, ["abc", "wxyz"], toy_tasks.TASKS["reverse"][1], EOS)
    assert ids.shape == (2, 1 + 5 + 5) and mask.shape == (2, 10)
    for row, m, word in zip(ids, mask, ["abc", "wxyz"]):
        targets = row[1:][m == 1]  # the tokens the loss is taken on
        assert t.decode(targets[:-1].tolist()) == word[::-1] and targets[-1] == EOS
        assert t.decode(row[1:1 + len(word) + 1].tolist()) == word + "="


def test_training_lowers_the_loss(tok):
    _, t = tok
    params = dummy_params(CFG, "float32", seed=0)
    data = toy_tasks.examples(t, toy_tasks.random_words(np.random.default_rng(0), 64), toy_tasks.BASE_TASK[1], EOS)
    before = float(toy_tasks._loss(jnp.asarray(data[0]), jnp.asarray(data[1]),
                                   toy_tasks._logits(params, CFG, jnp.asarray(data[0]))))
    _, after = toy_tasks.train_base(params, CFG, t, EOS, steps=40)
    assert after < 0.7 * before, (before, after)


def test_saved_adapter_serves_as_trained(tok, tmp_path):
    """A LoRA with random A and B (both non-zero), saved by save_adapter and served by the engine,
    gives the greedy tokens and logprobs of toy_tasks' own forward with the same LoRA."""
    d, t = tok
    params = dummy_params(CFG, "float32", seed=1)
    save_hf_weights(params, CFG, d)
    key = jax.random.key(3)
    lora = {}
    for k, module in enumerate(toy_tasks.LORA_MODULES):
        fin, fout = CFG.module_shape(module)
        ka, kb = jax.random.split(jax.random.fold_in(key, k))
        lora[module] = (0.3 * jax.random.normal(ka, (CFG.num_hidden_layers, fin, 4)),
                        0.3 * jax.random.normal(kb, (CFG.num_hidden_layers, 4, fout)))
    toy_tasks.save_adapter(tmp_path / "ad", CFG, lora, 2.0)
    prompt = t.encode("pool=").ids
    llm = LLM(d, adapters={"ad": str(tmp_path / "ad")}, dtype="float32", pool_pages=64, max_num_seqs=2)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)
    got = llm.generate([prompt, prompt], sp, adapter=["ad", None])
    for out, with_lora in zip(got, (lora, None)):
        ids = list(prompt)
        for token, logprob in zip(out.token_ids, out.logprobs):
            apply = toy_tasks.lora_apply(with_lora, 2.0) if with_lora else None
            logits = toy_tasks._logits(params, CFG, jnp.asarray([ids]), apply)[0, -1]
            logp = jax.nn.log_softmax(logits)
            assert token == int(jnp.argmax(logits))
            assert logprob == pytest.approx(float(logp[token]), abs=1e-4)
            ids.append(token)
    assert got[0].token_ids != got[1].token_ids  # the adapter changes the output
