"""Model shapes: one dataclass, filled from configs/models/*.toml or from a HF config.json."""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(os.environ.get("SLORA_CONFIG_DIR", Path(__file__).resolve().parents[2] / "configs"))

# The projections an adapter may target, in the order the engine stores them.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
QKV_MODULES = ("q_proj", "k_proj", "v_proj")  # read the same x; Qwen2's biased projections

# A projection's extra tensors sit beside its weight in a layer's params (model.Params) under
# these suffixes: its bias (weights.py reads it) and its int8 row scales (quant.py makes them).
BIAS, SCALE = "_bias", "_scale"


def bias_key(module: str) -> str:
    return module + BIAS


def scale_key(module: str) -> str:
    return module + SCALE


def projection_of(key: str) -> str:
    """The projection a layer-params key belongs to: "q_proj_scale" -> "q_proj" (others unchanged)."""
    return key.removesuffix(BIAS).removesuffix(SCALE)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str = "custom"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None  # sorted (key, value) pairs so the config stays hashable
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | tuple | None = 2
    # Mistral-style sliding-window attention (config.json's sliding_window; None: full attention).
    # The engine attends to the whole context, which is exact while a sequence fits the window, so
    # it keeps sequences within it (context_limit).
    sliding_window: int | None = None
    # The projections that add a bias (Qwen2: q, k and v; Llama's attention_bias: q, k, v and o;
    # mlp_bias: gate, up and down). Adapters never carry one: PEFT's LoRA adds no bias.
    bias_modules: tuple = ()
    # Qwen3: an RMSNorm over each head's q and k (weights [head_dim]) before RoPE
    qk_norm: bool = False

    def __post_init__(self):
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        if isinstance(self.bias_modules, list):
            object.__setattr__(self, "bias_modules", tuple(self.bias_modules))
        if set(self.bias_modules) - set(TARGET_MODULES):
            raise ValueError(f"bias_modules {self.bias_modules} names a module that is not a projection "
                             f"({', '.join(TARGET_MODULES)})")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling_dict.get("rope_type", self.rope_scaling_dict.get("type"))
            if kind not in ("llama3", "linear", "default"):
                raise ValueError(f"rope_scaling type {kind!r} is not supported (llama3, linear)")

    @property
    def context_limit(self) -> int:
        """The longest sequence this engine serves exactly: max_position_embeddings, or the
        sliding window if that is shorter."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @property
    def rope_scaling_dict(self) -> dict:
        return dict(self.rope_scaling or ())

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a projection, as a LoRA A/B pair sees it."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size), "k_proj": (h, self.kv_size), "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }[module]

    def num_params(self) -> int:
        per_layer = sum(a * b for a, b in map(self.module_shape, TARGET_MODULES)) + 2 * self.hidden_size + \
            sum(self.module_shape(m)[1] for m in self.bias_modules) + 2 * self.head_dim * self.qk_norm
        emb = self.vocab_size * self.hidden_size
        return self.num_hidden_layers * per_layer + emb * (1 if self.tie_word_embeddings else 2) + self.hidden_size


_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}


def _bias_modules(arch: str, d: dict) -> tuple[str, ...]:
    """The projections with a bias, from config.json: Qwen2's q, k and v always; Llama's (and
    Qwen3's) attention_bias (q, k, v, o) and mlp_bias (gate, up, down)."""
    if arch == "qwen2":
        return QKV_MODULES
    return (ATTN_MODULES if d.get("attention_bias") else ()) + (MLP_MODULES if d.get("mlp_bias") else ())


def _from_dict(name: str, d: dict[str, Any]) -> ModelConfig:
    known = {k: v for k, v in d.items() if k in _FIELDS}
    known.pop("name", None)
    if known.get("head_dim") is None:
        known.pop("head_dim", None)
    return ModelConfig(name=name, **known)


def _rope_from_hf(d: dict) -> dict:
    """transformers 5 writes rope settings only under `rope_parameters` (theta inside it);
    older configs use top-level `rope_theta` and `rope_scaling`."""
    rp = d.get("rope_parameters")
    if not rp:
        return d
    d = dict(d)
    if "rope_theta" in rp:
        d["rope_theta"] = rp["rope_theta"]
    kind = rp.get("rope_type", rp.get("type", "default"))
    d["rope_scaling"] = None if kind == "default" else {k: v for k, v in rp.items() if k != "rope_theta"}
    return d


def model_config_names() -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / "models").glob("*.toml") if p.stem != "base")


def load_model_config(model: "str | os.PathLike | ModelConfig") -> ModelConfig:
    """A shape name from configs/models, a Hugging Face model directory holding config.json, or a
    ModelConfig (returned as is)."""
    if isinstance(model, ModelConfig):
        return model
    path = Path(model)
    if (path / "config.json").is_file():
        d = json.loads((path / "config.json").read_text())
        arch = d.get("model_type", "llama")
        if arch not in ("llama", "mistral", "qwen2", "qwen3"):
            raise ValueError(f"{path}/config.json: model_type {arch!r} is not a Llama-family model "
                             f"(llama, mistral, qwen2, qwen3)")
        d = {**d, "bias_modules": _bias_modules(arch, d), "qk_norm": arch == "qwen3"}
        if d.get("use_sliding_window") is False:  # a window that is written down but not used
            d = {**d, "sliding_window": None}
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{path}/config.json: hidden_act {act!r} is not supported (silu)")
        return _from_dict(path.name, _rope_from_hf(d))
    shape = CONFIG_DIR / "models" / f"{model}.toml"
    if not shape.is_file():
        raise ValueError(
            f"model {str(model)!r} is neither a directory with config.json nor a known shape "
            f"({', '.join(model_config_names())})")
    d = tomllib.loads((CONFIG_DIR / "models" / "base.toml").read_text())
    d.update(tomllib.loads(shape.read_text()))
    return _from_dict(str(model), d)
