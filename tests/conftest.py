"""Shared pytest fixtures.

The correctness oracle (Hugging Face transformers + peft, torch on CPU, float32) lives in its own
interpreter. The session-scoped `oracle` fixture runs it ONCE per pytest session, in one subprocess:
tests/oracle/run_oracle.py --build-fixtures builds two tiny random Llama models (mha, gqa) and their
PEFT adapters, then computes prompt logits and greedy continuations for every (model, adapter or base,
prompt). Tests and oracle talk only through files (safetensors, JSON, npz).

Environment:
  SLORA_ORACLE_PYTHON  the oracle interpreter (default: <repo>/.venv-oracle/bin/python)
  SLORA_SKIP_ORACLE=1  skip the oracle tests instead of failing when no oracle interpreter exists
  SLORA_ORACLE_CACHE   optional directory: reuse oracle outputs across pytest sessions (keyed by a hash
                       of the oracle scripts, the prompts and the interpreter path)
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
ORACLE_DIR = Path(__file__).resolve().parent / "oracle"
BASE = "__base__"  # run_oracle.py's label for the base model (adapter None)

# The prompts every oracle output is computed for: token ids in [3, 250), lengths 1..24.
# Longest prompt + 8 new tokens = 32 = the gqa model's original_max_position_embeddings.
PROMPTS: list[list[int]] = [
    [236],
    [157, 171, 224, 145, 194],
    [208, 58, 16, 77, 73, 218, 228, 4, 126],
    [205, 35, 199, 32, 118, 204, 77, 87, 71, 180, 65, 247, 112],
    [121, 127, 146, 139, 128, 248, 202, 198, 175, 156, 87, 247, 118, 56, 211, 42, 214],
    [154, 31, 13, 112, 11, 37, 130, 242, 118, 202, 229, 206, 158, 112, 129, 68, 125, 96, 64, 248,
     5, 27, 50, 242],
]
MAX_TOKENS = 8


@pytest.fixture(autouse=True, scope="module")
def _fresh_jax_caches():
    """Each test module starts with JAX's compiled executables of the modules before it dropped.
    One process compiles hundreds of XLA:CPU executables over the suite; with those of
    test_adapters and test_bench still loaded, test_engine's fused-kernel test aborted inside
    XLA's compile (seen in fresh-clone runs of `make test`; the same module alone passes)."""
    yield
    import gc

    import jax
    jax.clear_caches()
    gc.collect()


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` are skipped unless JAX sees a GPU."""
    gpu_items = [it for it in items if it.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    try:
        import jax
        has_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    except Exception:  # noqa: BLE001 - no usable jax backend means no GPU
        has_gpu = False
    if not has_gpu:
        skip = pytest.mark.skip(reason="needs a GPU (JAX sees none)")
        for it in gpu_items:
            it.add_marker(skip)


class Oracle:
    """Read access to one oracle run: fixture paths and reference outputs."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.index = json.loads((self.root / "index.json").read_text())
        self.manifest = self.index["manifest"]
        self.prompts: list[list[int]] = self.index["prompts"]
        self.max_tokens: int = self.index["max_tokens"]
        with np.load(self.root / "oracle.npz") as z:
            self._arrays = {k: z[k] for k in z.files}

    # fixtures
    @property
    def models(self) -> list[str]:
        return list(self.manifest["models"])

    def model_dir(self, model: str) -> str:
        if model in self.manifest["models"]:
            return self.manifest["models"][model]
        return self.manifest["aliases"][model]["path"]

    def adapters(self, model: str) -> list[str]:
        return list(self.manifest["adapters"][model])

    def adapter_dir(self, model: str, adapter: str) -> str:
        return self.manifest["adapters"][model][adapter]

    # reference outputs; adapter None = base model
    def _get(self, model: str, adapter: str | None, prompt: int, field: str) -> np.ndarray:
        label = BASE if adapter is None else adapter
        return self._arrays[f"{model}__{label}__{prompt}__{field}"]

    def logits(self, model, adapter, prompt) -> np.ndarray:
        """[T, V] float32: the logits at every position of prompt `prompt` (an index into prompts)."""
        return self._get(model, adapter, prompt, "logits")

    def tokens(self, model, adapter, prompt) -> list[int]:
        return [int(t) for t in self._get(model, adapter, prompt, "tokens")]

    def logprobs(self, model, adapter, prompt) -> np.ndarray:
        return self._get(model, adapter, prompt, "logprobs")

    def margins(self, model, adapter, prompt) -> np.ndarray:
        """Top-1 minus top-2 logit at each greedy step."""
        return self._get(model, adapter, prompt, "margins")


def oracle_python() -> str | None:
    """The oracle interpreter, or None when there is none and SLORA_SKIP_ORACLE=1."""
    py = os.environ.get("SLORA_ORACLE_PYTHON")
    if py:
        if Path(py).exists():
            return str(Path(py).absolute())
        if (REPO / py).exists():  # relative to the repository, as the Makefile passes it
            return str(REPO / py)
        if _which(py):
            return _which(py)
        pytest.fail(f"SLORA_ORACLE_PYTHON={py!r} does not exist", pytrace=False)
    default = REPO / ".venv-oracle" / "bin" / "python"
    if default.exists():
        return str(default)
    if os.environ.get("SLORA_SKIP_ORACLE") == "1":
        return None
    pytest.fail(
        f"no oracle interpreter: set SLORA_ORACLE_PYTHON, or run `make oracle` to build {default} "
        "(transformers + peft + torch CPU; see tests/oracle/requirements.txt), "
        "or set SLORA_SKIP_ORACLE=1 to skip the oracle tests", pytrace=False)


def _which(name: str) -> str | None:
    import shutil
    return shutil.which(name)


def _oracle_env() -> dict[str, str]:
    env = dict(os.environ)
    # A different interpreter: nothing of the engine's Python environment may leak into it.
    for k in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP"):
        env.pop(k, None)
    env.update(CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    return env


def _cache_key(py: str) -> str:
    h = hashlib.sha256()
    for f in sorted(ORACLE_DIR.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    h.update(json.dumps([PROMPTS, MAX_TOKENS, py]).encode())
    return h.hexdigest()[:16]


def run_oracle(py: str, work: Path) -> Oracle:
    """One subprocess: build the fixtures under work/fixtures, oracle outputs under work/oracle."""
    prompts = work / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    out = work / "oracle"
    cmd = [py, str(ORACLE_DIR / "run_oracle.py"), "--build-fixtures", str(work / "fixtures"),
           "--prompts", str(prompts), "--out", str(out), "--max-tokens", str(MAX_TOKENS)]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=_oracle_env(), capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the oracle timed out after 900 s: {' '.join(cmd)}", pytrace=False)
    dt = time.perf_counter() - t0
    (work / "oracle.log").write_text(p.stdout + "\n--- stderr ---\n" + p.stderr)
    if p.returncode != 0:
        pytest.fail(f"the oracle failed (exit {p.returncode}, {dt:.0f} s): {' '.join(cmd)}\n"
                    f"--- stdout ---\n{p.stdout[-4000:]}\n--- stderr ---\n{p.stderr[-6000:]}", pytrace=False)
    sys.stderr.write(f"\n[oracle] {dt:.1f} s in {py}\n")
    return Oracle(out)


@pytest.fixture(scope="session")
def oracle(tmp_path_factory) -> Oracle:
    """Fixtures + oracle outputs, built once per session (or reused from SLORA_ORACLE_CACHE)."""
    py = oracle_python()
    if py is None:
        pytest.skip("SLORA_SKIP_ORACLE=1 and no oracle interpreter")
    cache = os.environ.get("SLORA_ORACLE_CACHE")
    if cache:
        work = Path(cache) / _cache_key(py)
        if (work / "oracle" / "index.json").is_file():
            o = Oracle(work / "oracle")
            if all(Path(d).is_dir() for d in o.manifest["models"].values()):
                return o
        work.mkdir(parents=True, exist_ok=True)
        return run_oracle(py, work)
    return run_oracle(py, tmp_path_factory.mktemp("slora_oracle"))
