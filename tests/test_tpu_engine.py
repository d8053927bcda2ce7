"""The TPU backends ("pallas_tpu") through the engine: selection, the clear error off a TPU, and
the engine's jitted decode and prefill steps cross-lowered for TPU at real model shapes (Mosaic's
tile rules checked without a TPU). Parity with the transformers+peft oracle under these backends
runs in tests/test_parity.py with SLORA_TPU_INTERPRET=1 and SLORA_TEST_LLM_OPTIONS (docs/tpu.md)."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.tpu import INTERPRET_ENV
from slora_jax.engine.step import StepInputs, forward_sample
from slora_jax.lora import LoraInputs, rows_needed
from slora_jax.lora.backends import TpuBackend
from slora_jax.lora.selection import check_backend, select, step_backend
from slora_jax.model.config import load_model_config
from slora_jax.model.layout import AdapterLayout, pack_adapter
from slora_jax.model.peft import load_peft_adapter, random_peft_adapter
from slora_jax.model.weights import _empty_tree, _set, hf_names
from tests.test_tpu_kernels import TPU_KINDS, _on_tpu

S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("slots", [1, 8, 64, 256])
def test_auto_picks_the_tpu_kernels_on_a_tpu(decode, slots):
    assert select(decode, slots, slots, 16, "tpu") == "pallas_tpu"
    assert step_backend("auto", decode, slots, slots, 16, "tpu") == "pallas_tpu"
    assert select(decode, slots, slots, 16, "cpu") == "xla"


def test_tpu_backend_off_a_tpu_needs_interpret(monkeypatch):
    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    for platform in ("cpu", "gpu"):
        with pytest.raises(ValueError, match="pallas_tpu.*needs a TPU"):
            check_backend("pallas_tpu", platform)
    check_backend("pallas_tpu", "tpu")
    monkeypatch.setenv(INTERPRET_ENV, "1")
    check_backend("pallas_tpu", "cpu")


def test_engine_refuses_tpu_attention_off_a_tpu(monkeypatch):
    from slora_jax.config import EngineConfig
    from slora_jax.engine.engine import LoraChoices
    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    with pytest.raises(ValueError, match="attention_backend='pallas_tpu' needs a TPU"):
        LoraChoices.resolve(EngineConfig(attention_backend="pallas_tpu"))


def _abstract_params(cfg, dtype):
    tree = _empty_tree(cfg)
    for path, shape in hf_names(cfg).values():
        _set(tree, path, S(shape, dtype))
    return tree


def _step_inputs(cfg, *, decode: bool, modules, seqs: int, tokens: int, slots: int, max_rank: int, pages: int,
                 page_size: int):
    """Abstract StepInputs of one step as the engine builds them under lora_backend and
    attention_backend "pallas_tpu"."""
    i32, f32, w = jnp.int32, jnp.float32, cfg.kv_size
    rows = {m: tuple(S((slots, rows_needed(max_rank, f, w, whole_rows=True)), i32) for f in cfg.module_shape(m))
            for m in modules}
    ranks = {m: S((slots,), i32) for m in modules}
    plan = TpuBackend().plan(t=tokens, token_slot=S((tokens,), i32), seg_starts=S((slots + 1,), i32), rows=rows,
                             ranks=ranks, decode=decode, cfg=cfg, max_rank=max_rank, dtype=jnp.bfloat16)
    assert isinstance(plan, LoraInputs) and plan.backend == "pallas_tpu"
    # Decode reads `pages` columns of a page table; prefill, `pages` context pages.
    context = {} if decode else dict(ctx_pages=S((pages,), i32), ctx_page_seq=S((pages,), i32),
                                     ctx_page_fill=S((pages,), i32))
    return StepInputs(tokens=S((tokens,), i32), positions=S((tokens,), i32), kv_slot=S((tokens,), i32),
                      token_seq=S((tokens,), i32), page_table=S((seqs, pages if decode else 1), i32),
                      ctx_lens=S((seqs,), i32), sample_idx=S((seqs,), i32), temperature=S((seqs,), f32),
                      top_k=S((seqs,), i32), top_p=S((seqs,), f32), seeds=S((seqs,), jnp.uint32), steps=S((seqs,), i32),
                      lora=plan, decode=decode, attention_backend="pallas_tpu", **context)


@pytest.mark.parametrize("kind", TPU_KINDS)
@pytest.mark.parametrize("model", ["llama-7b", "llama-3-8b"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_engine_step_lowers_for_tpu(kind, model, decode, monkeypatch):
    """The engine's forward_sample jit (every layer's LoRA on all seven modules, attention, the
    sampler) lowered for TPU with abstract bf16 weights: no Mosaic tile error, one custom call per
    kernel, in seconds. llama-7b's MLP (11008 is 2.69 rows of 4096) takes the whole-rows layout."""
    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    cfg = load_model_config(model)
    w = cfg.kv_size
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    seqs, tokens = (64, 64) if decode else (8, 512)
    inp = _step_inputs(cfg, decode=decode, modules=modules, seqs=seqs, tokens=tokens, slots=64 if decode else 8,
                       max_rank=64, pages=128, page_size=16)
    pool = [S((4096, 2, 16, w), jnp.bfloat16)] * cfg.num_hidden_layers
    start = time.perf_counter()
    with _on_tpu(kind):
        text = forward_sample.trace(_abstract_params(cfg, jnp.bfloat16), pool, inp, cfg=cfg).lower(
            lowering_platforms=("tpu",)).as_text()
    seconds = time.perf_counter() - start
    kernels = ["_shrink_kernel", "_expand_kernel", "_decode_kernel" if decode else "_prefill_kernel"]
    assert text.count("tpu_custom_call") >= len(kernels)  # one per distinct kernel and shape
    for name in kernels:
        assert name in text, name
    assert seconds < 60, f"lowering took {seconds:.1f} s"


# ---------------------------------------------------------------------------------------------
# The whole-rows layout: features that are not whole pool rows (llama-7b's MLP)

NOT_WHOLE = dataclasses.replace(load_model_config("tiny"), name="tiny-mlp100", intermediate_size=100,
                                num_hidden_layers=1)  # W = 32; one layer keeps interpret mode short


@pytest.fixture(scope="module")
def not_whole_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"mlp": random_peft_adapter(root / "mlp", NOT_WHOLE, rank=8, targets=["gate_proj", "up_proj", "down_proj"],
                                       seed=1),
            "all": random_peft_adapter(root / "all", NOT_WHOLE, rank=4, targets="all-linear", seed=2)}


def test_whole_rows_layout_packs_each_rank_row_on_whole_rows(not_whole_adapters):
    cfg, w = NOT_WHOLE, NOT_WHOLE.kv_size
    adapter = load_peft_adapter(not_whole_adapters["all"], cfg)
    flat = AdapterLayout.of(adapter, cfg, 16)
    whole = AdapterLayout.of(adapter, cfg, 16, whole_rows=True)
    assert whole.whole_rows and whole.modules["q_proj"] == flat.modules["q_proj"]  # 64 = 2 rows: the same
    up = whole.modules["up_proj"]
    assert (up.a_rows, up.b_rows) == (4 * 2, 4 * 4) and flat.modules["up_proj"].b_rows == 13  # 100 -> 4 rows
    rows = pack_adapter(adapter, whole, cfg, np.float32)
    wt = adapter.weights[(0, "up_proj")]
    b = rows[0, up.b_row:up.b_row + up.b_rows].reshape(4, 4 * w)
    np.testing.assert_allclose(b[:, :100], np.asarray(wt.b, np.float32) * wt.scale, rtol=1e-6)
    assert not b[:, 100:].any()  # the padding is zeros
    down = whole.modules["down_proj"]
    a = rows[0, down.a_row:down.a_row + down.a_rows].reshape(4, 4 * w)
    np.testing.assert_array_equal(a[:, :100], adapter.weights[(0, "down_proj")].a.T)
    # tensor parallel: device d's 16 columns of each row hold its 50 features of each rank row
    split = pack_adapter(adapter, whole, cfg, np.float32, tp=2)
    for d in range(2):
        dev = split[0, up.b_row:up.b_row + up.b_rows, d * 16:(d + 1) * 16].reshape(4, 64)
        np.testing.assert_allclose(dev[:, :50], b[:, d * 50:(d + 1) * 50], rtol=1e-6)
        assert not dev[:, 50:].any()


def test_engine_whole_rows_layout_matches_xla(not_whole_adapters, monkeypatch):
    """An engine on a model whose MLP is not whole pool rows (100 over W = 32) under
    lora_backend "pallas_tpu" (TPU interpret mode) lays adapters out on whole rows and gives the
    xla backend's greedy tokens and logprobs; a store laid out flat is refused."""
    from slora_jax import LLM, EngineConfig, SamplingParams
    from slora_jax.engine.adapter_store import AdapterStore
    from slora_jax.engine.engine import Engine
    monkeypatch.setenv(INTERPRET_ENV, "1")
    prompts, names = [[5, 9, 3, 77, 12], [8, 1, 100], [40, 41, 42, 43, 44, 45, 46]], ["mlp", None, "all"]
    sp = SamplingParams(max_tokens=2, temperature=0.0, logprobs=True, ignore_eos=True)
    out = {}
    for backend in ("xla", "pallas_tpu"):
        llm = LLM(NOT_WHOLE, adapters=not_whole_adapters, dtype="float32", lora_backend=backend, pool_pages=64)
        assert llm.store.whole_rows == (backend == "pallas_tpu")
        out[backend] = llm.generate(prompts, sp, adapter=names)
    assert llm.store.get("mlp").layout.rows > AdapterLayout.of(
        load_peft_adapter(not_whole_adapters["mlp"], NOT_WHOLE), NOT_WHOLE, 16).rows
    for ref, got in zip(out["xla"], out["pallas_tpu"]):  # a prefill step's token and a decode step's
        assert list(got.token_ids) == list(ref.token_ids)
        np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-4, rtol=0)
    flat = AdapterStore(NOT_WHOLE, np.float32, 16, 16)
    with pytest.raises(ValueError, match="whole pool rows"):
        Engine(NOT_WHOLE, llm.params, "float32", flat, EngineConfig(lora_backend="pallas_tpu"), 64)
