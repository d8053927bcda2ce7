"""Parity with the correctness oracle (Hugging Face transformers + peft, torch CPU, float32).

Parity means (docs: DESIGN.md, "Correctness oracle"):
  - prompt logits within 1e-4 of the oracle's, at every position of every row;
  - greedy tokens identical, per-token logprobs within 1e-3, finish_reason "length";
  - in mixed-adapter batches with base rows, for two models (mha; gqa with tied embeddings and
    llama3 rope scaling) and five adapters (ranks 2..16, q/k/v/o/gate/up/down, rslora, rank_pattern,
    alpha_pattern, regex target_modules, layers_to_transform).

The fixtures and oracle outputs come from the session-scoped `oracle` fixture (tests/conftest.py).
SLORA_TEST_LLM_OPTIONS (JSON) adds engine options to every LLM built here, e.g.
'{"lora_backend": "pallas", "page_size": 1}'.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

pytestmark = pytest.mark.oracle

MODELS = ("mha", "gqa")
LOGITS_TOL = 1e-4
LOGPROB_TOL = 1e-3

# The mixed batch: (prompt index into conftest.PROMPTS, adapter or None for the base model).
# Every adapter appears; base twice; r8_qv twice with different prompts; prompt 0 under two adapters
# and prompt 5 under three (base, r16_rslora, r8_qv) in the same batch; lengths 1..24.
MIXED: list[tuple[int, str | None]] = [
    (3, None),
    (1, "r8_qv"),
    (0, "r4_all"),
    (5, "r16_rslora"),
    (2, "pattern"),
    (4, "layers"),
    (5, "r8_qv"),
    (0, None),
]
ROW_IDS = [f"row{i}-{a or 'base'}-prompt{p}" for i, (p, a) in enumerate(MIXED)]


def _llm_options() -> dict:
    raw = os.environ.get("SLORA_TEST_LLM_OPTIONS", "")
    return json.loads(raw) if raw else {}


def _api():
    try:
        from slora_jax import LLM, SamplingParams
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"`from slora_jax import LLM, SamplingParams` failed: {e!r}", pytrace=False)
    return LLM, SamplingParams


def _greedy():
    _, SamplingParams = _api()
    return SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, ignore_eos=True)


class _Engines:
    """One LLM per model with all of its adapters, built lazily and shared by the module's tests;
    the mixed-batch results are computed once per model (an error is remembered, not retried)."""

    def __init__(self, oracle):
        self.oracle = oracle
        self.llms: dict[str, object] = {}
        self.results: dict[tuple[str, str], object] = {}

    def llm(self, model: str):
        if model not in self.llms:
            LLM, _ = _api()
            base = self.oracle.manifest["aliases"].get(model, {}).get("same_as", model)
            adapters = {a: self.oracle.adapter_dir(base, a) for a in self.oracle.adapters(base)}
            self.llms[model] = LLM(self.oracle.model_dir(model), adapters=adapters, dtype="float32",
                                   **_llm_options())
        return self.llms[model]

    def _cached(self, key, fn):
        if key not in self.results:
            try:
                self.results[key] = ("ok", fn())
            except Exception as e:  # noqa: BLE001
                self.results[key] = ("err", e)
        kind, value = self.results[key]
        if kind == "err":
            raise value
        return value

    def mixed_logits(self, model: str):
        prompts = [self.oracle.prompts[p] for p, _ in MIXED]
        return self._cached((model, "logits"), lambda: self.llm(model).prompt_logits(
            prompts, adapter=[a for _, a in MIXED]))

    def mixed_generate(self, model: str):
        prompts = [self.oracle.prompts[p] for p, _ in MIXED]
        return self._cached((model, "generate"), lambda: self.llm(model).generate(
            prompts, _greedy(), adapter=[a for _, a in MIXED]))


@pytest.fixture(scope="module")
def engines(oracle):
    return _Engines(oracle)


def _check_logits(ours, oracle, model, adapter, p, what=""):
    ref = oracle.logits(model, adapter, p)
    ours = np.asarray(ours)
    assert ours.dtype == np.float32, f"{what}logits dtype {ours.dtype}, want float32"
    assert ours.shape == ref.shape, f"{what}logits shape {ours.shape}, oracle {ref.shape}"
    err = np.abs(ours.astype(np.float64) - ref).max(axis=-1)
    worst = int(np.argmax(err))
    assert err.max() < LOGITS_TOL, (
        f"{what}{model}/{adapter or 'base'} prompt {p} (len {len(oracle.prompts[p])}): "
        f"max |logits - oracle| = {err.max():.3g} at position {worst} (tol {LOGITS_TOL}); "
        f"per position: {np.array2string(err, precision=2)}")


def _check_generation(out, oracle, model, adapter, p, what=""):
    want = oracle.tokens(model, adapter, p)
    got = [int(t) for t in out.token_ids]
    tag = f"{what}{model}/{adapter or 'base'} prompt {p} (len {len(oracle.prompts[p])})"
    if got != want:
        k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        margin = oracle.margins(model, adapter, p)
        raise AssertionError(
            f"{tag}: greedy tokens {got} != oracle {want}; first difference at step {k} "
            f"(oracle top-1 minus top-2 logit there: {margin[k] if k < len(margin) else 'n/a'})")
    assert out.finish_reason == "length", f"{tag}: finish_reason {out.finish_reason!r}, want 'length'"
    assert out.logprobs is not None and len(out.logprobs) == len(want), \
        f"{tag}: {0 if out.logprobs is None else len(out.logprobs)} logprobs for {len(want)} tokens"
    lp = np.asarray(out.logprobs, dtype=np.float64)
    ref = oracle.logprobs(model, adapter, p).astype(np.float64)
    err = np.abs(lp - ref)
    assert err.max() < LOGPROB_TOL, (
        f"{tag}: max |logprob - oracle| = {err.max():.3g} at step {int(np.argmax(err))} "
        f"(tol {LOGPROB_TOL}); ours {np.round(lp, 5).tolist()}, oracle {np.round(ref, 5).tolist()}")


# --- the oracle itself: needs no engine ---------------------------------------------------------

def test_oracle_sanity(oracle):
    """The fixtures are not vacuous: every adapter moves the logits and the greedy tokens."""
    assert not oracle.index["failures"], oracle.index["failures"]
    assert set(oracle.models) == set(MODELS)
    for model in MODELS:
        adapters = oracle.adapters(model)
        assert {a for _, a in MIXED if a} == set(adapters), \
            f"MIXED must cover exactly the adapters built for {model}: {adapters}"
        n = len(oracle.prompts)
        for a in adapters:
            effect = max(np.abs(oracle.logits(model, a, p) - oracle.logits(model, None, p)).max()
                         for p in range(n))
            assert effect > 0.05, f"{model}/{a} barely changes the logits ({effect:.3g})"
            assert any(oracle.tokens(model, a, p) != oracle.tokens(model, None, p) for p in range(n)), \
                f"{model}/{a} never changes a greedy token"


# --- mixed batches ------------------------------------------------------------------------------

@pytest.mark.parametrize("row", range(len(MIXED)), ids=ROW_IDS)
@pytest.mark.parametrize("model", MODELS)
def test_mixed_prompt_logits(engines, oracle, model, row):
    logits = engines.mixed_logits(model)
    assert len(logits) == len(MIXED)
    p, a = MIXED[row]
    _check_logits(logits[row], oracle, model, a, p)


@pytest.mark.parametrize("row", range(len(MIXED)), ids=ROW_IDS)
@pytest.mark.parametrize("model", MODELS)
def test_mixed_generate(engines, oracle, model, row):
    outs = engines.mixed_generate(model)
    assert len(outs) == len(MIXED)
    p, a = MIXED[row]
    _check_generation(outs[row], oracle, model, a, p)


@pytest.mark.parametrize("model", MODELS)
def test_single_adapter_for_all_rows(engines, oracle, model):
    """`adapter` given once (a name, or None) applies to every row."""
    llm = engines.llm(model)
    rows = [0, 3, 5]
    for a in ("pattern", None):
        logits = llm.prompt_logits([oracle.prompts[p] for p in rows], adapter=a)
        for p, lg in zip(rows, logits):
            _check_logits(lg, oracle, model, a, p, what=f"adapter={a!r} for all rows: ")


@pytest.mark.parametrize("model", MODELS)
def test_batch_independence(engines, oracle, model):
    """A row's result does not depend on which other rows share its batch."""
    llm = engines.llm(model)
    mixed = engines.mixed_generate(model)
    mixed_logits = engines.mixed_logits(model)
    p, a = MIXED[3]
    alone = llm.generate([oracle.prompts[p]], _greedy(), adapter=[a])[0]
    assert list(alone.token_ids) == list(mixed[3].token_ids), \
        f"{model} row 3 ({a}): alone {alone.token_ids} != in the mixed batch {mixed[3].token_ids}"
    np.testing.assert_allclose(alone.logprobs, mixed[3].logprobs, atol=LOGPROB_TOL, rtol=0)
    for row in (0, 3, 4):
        p, a = MIXED[row]
        lg = llm.prompt_logits([oracle.prompts[p]], adapter=a)[0]
        np.testing.assert_allclose(lg, mixed_logits[row], atol=LOGITS_TOL, rtol=0,
                                   err_msg=f"{model} row {row}: prompt logits alone vs in the mixed batch")
    # The same request twice in one batch: identical rows.
    p, a = MIXED[3]
    twice = llm.generate([oracle.prompts[p]] * 2, _greedy(), adapter=[a, a])
    assert list(twice[0].token_ids) == list(twice[1].token_ids) == list(mixed[3].token_ids)


# --- adapters registered at run time ------------------------------------------------------------

@pytest.mark.parametrize("model", MODELS)
def test_load_adapter_new_name(engines, oracle, model):
    """An adapter registered after start-up under a new name serves exactly its weights."""
    llm = engines.llm(model)
    name = f"late_{model}"
    llm.load_adapter(name, oracle.adapter_dir(model, "pattern"))
    rows = [(2, name, "pattern"), (4, None, None), (1, name, "pattern"), (0, "r8_qv", "r8_qv")]
    outs = llm.generate([oracle.prompts[p] for p, _, _ in rows], _greedy(), adapter=[n for _, n, _ in rows])
    for out, (p, _, ref) in zip(outs, rows):
        _check_generation(out, oracle, model, ref, p, what=f"after load_adapter({name!r}): ")
    logits = llm.prompt_logits([oracle.prompts[p] for p, _, _ in rows], adapter=[n for _, n, _ in rows])
    for lg, (p, _, ref) in zip(logits, rows):
        _check_logits(lg, oracle, model, ref, p, what=f"after load_adapter({name!r}): ")


@pytest.mark.parametrize("model", MODELS)
def test_replace_adapter_never_stale(engines, oracle, model):
    """load_adapter on an existing name replaces it: the next request sees only the new weights."""
    llm = engines.llm(model)
    name = f"swap_{model}"
    rows = [5, 2]
    for ref in ("r16_rslora", "r4_all", "layers"):  # different ranks and targets each time
        llm.load_adapter(name, oracle.adapter_dir(model, ref))
        outs = llm.generate([oracle.prompts[p] for p in rows], _greedy(), adapter=name)
        for out, p in zip(outs, rows):
            _check_generation(out, oracle, model, ref, p, what=f"{name} now holding {ref}: ")
    llm.unload_adapter(name)
    assert name not in llm.adapters


# --- config.json in the transformers-4 layout ---------------------------------------------------

def test_legacy_config_layout(oracle):
    """gqa_legacy: gqa's weights with top-level rope_theta + rope_scaling (as Llama-3 checkpoints
    on the Hub have them) instead of transformers 5's rope_parameters: the same outputs."""
    LLM, _ = _api()
    llm = LLM(oracle.model_dir("gqa_legacy"), adapters={"r4_all": oracle.adapter_dir("gqa", "r4_all")},
              dtype="float32", **_llm_options())
    rows = [(5, None), (4, "r4_all"), (1, None)]
    logits = llm.prompt_logits([oracle.prompts[p] for p, _ in rows], adapter=[a for _, a in rows])
    for lg, (p, a) in zip(logits, rows):
        _check_logits(lg, oracle, "gqa", a, p, what="gqa_legacy: ")
    outs = llm.generate([oracle.prompts[p] for p, _ in rows], _greedy(), adapter=[a for _, a in rows])
    for out, (p, a) in zip(outs, rows):
        _check_generation(out, oracle, "gqa", a, p, what="gqa_legacy: ")


# --- the paged engine under pressure ------------------------------------------------------------

@pytest.mark.parametrize("config", ["page_size_1", "tight_pool", "pallas_kernels", "ranksplit_lora", "prefix_caching"])
@pytest.mark.parametrize("model", MODELS)
def test_paged_engine_configurations(oracle, model, config, monkeypatch):
    """The mixed batch through token-granular pages (S-LoRA's page size 1); through a pool too
    small to hold every adapter at once with fewer sequence slots than requests (adapters are
    evicted and paged in again mid-run, requests queue); through the Pallas LoRA and decode
    attention kernels, with the rank-split decode kernel (triton_kernels/ranksplit.py; off the
    GPU its jnp stand-in from the same tables); with prefix caching, run twice so the second run
    starts from the first's cached pages. Every row still matches the oracle."""
    LLM, _ = _api()
    adapters = {a: oracle.adapter_dir(model, a) for a in oracle.adapters(model)}
    prompts = [oracle.prompts[p] for p, _ in MIXED]
    names = [a for _, a in MIXED]
    if config == "page_size_1":
        opts = dict(page_size=1)
    elif config == "prefix_caching":
        opts = dict(page_size=4, enable_prefix_caching=True)
    elif config in ("pallas_kernels", "ranksplit_lora"):  # interpret mode on the CPU
        opts = dict(lora_backend="pallas", attention_backend="pallas")
        if config == "ranksplit_lora":
            from slora_jax.engine import engine as engine_mod
            from triton_kernels import ranksplit as rsk
            launches, real = [], rsk.ranksplit_apply if rsk.unavailable_reason() is None else rsk.ranksplit_reference

            def spy(y, x, rows, table, **kw):
                launches.append(table[1].shape[0])  # its units' bound (traced: the step's shape)
                return real(y, x, rows, table, **kw)
            monkeypatch.setattr(engine_mod, "step_backend", lambda option, decode, *a, **k:
                                "ranksplit" if decode else "pallas")  # every decode step, as select() would
            monkeypatch.setattr(rsk, "ranksplit_apply", spy)
    else:
        opts = dict(page_size=4, max_num_seqs=3)
        probe = LLM(oracle.model_dir(model), adapters=adapters, dtype="float32", **{**_llm_options(), **opts,
                                                                                    "pool_pages": 4096})
        pages = sorted(probe.store.get(a).layout.pages for a in adapters)
        kv = opts["max_num_seqs"] * -(-(max(map(len, prompts)) + 8) // opts["page_size"])
        opts["pool_pages"] = 1 + kv + pages[-1] + pages[-2]  # at most two adapters at a time
        assert sum(pages) > pages[-1] + pages[-2]
    llm = LLM(oracle.model_dir(model), adapters=adapters, dtype="float32", **{**_llm_options(), **opts})
    outs = llm.generate(prompts, _greedy(), adapter=names)
    if config == "prefix_caching":
        outs = llm.generate(prompts, _greedy(), adapter=names)
        assert llm.stats()["prefix_cache"]["hits"] > 0
    for out, (p, a) in zip(outs, MIXED):
        _check_generation(out, oracle, model, a, p, what=f"{config}: ")
    stats = llm.stats()
    if config == "tight_pool":
        assert stats["evictions"] > 0, stats
    if config == "ranksplit_lora":  # decode steps took it
        assert launches and min(launches) > 0, launches
    cached = stats["prefix_cache"]["cached_pages"]
    assert stats["kv_pages"] == 0 and stats["free_pages"] == stats["total_pages"] - stats["adapter_pages"] - cached
    llm.engine.pool.check()
