"""PEFT LoRA adapters: load a PEFT adapter directory into host numpy arrays, per (layer, module).

A PEFT adapter directory holds `adapter_config.json` and `adapter_model.safetensors`. We follow the
semantics of PEFT 0.21 (`peft.tuners.tuners_utils.check_target_module_exists`,
`peft.utils.other.get_pattern_key`, `LoraLayer.update_layer`) so that an adapter means here exactly
what it means to `PeftModel.from_pretrained` on a `LlamaForCausalLM`:

- target modules are matched against the full module names of `LlamaForCausalLM`
  (`model.layers.3.self_attn.q_proj`, `lm_head`, ...);
- `rank_pattern` / `alpha_pattern` override `r` / `lora_alpha` per module (first matching key wins);
- scale = lora_alpha / r, or lora_alpha / sqrt(r) with `use_rslora`.

Everything the engine cannot serve exactly is refused at load time with an `AdapterError` that names
the offending field, tensor or file. Loading is a pure function: it builds a new `LoraAdapter` or
raises, and touches no global state.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Iterable

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from slora_jax.model.config import ATTN_MODULES, TARGET_MODULES, ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
BIN_WEIGHTS_FILE = "adapter_model.bin"

# What PEFT fills in when target_modules is null (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["llama"]).
DEFAULT_TARGET_MODULES = ("q_proj", "v_proj")
ALL_LINEAR = "all-linear"

_SERVE_DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}
_SOURCE_DTYPES = {np.dtype(np.float64), *_SERVE_DTYPES.values()}


class AdapterError(ValueError):
    """An adapter directory that cannot be served. The message names the field, tensor or file."""


@dataclasses.dataclass
class LoraWeights:
    """One projection's LoRA pair, laid out for `x @ a @ b` (PEFT stores the transposes)."""

    a: np.ndarray  # [in_features, r]
    b: np.ndarray  # [r, out_features]
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[1]


@dataclasses.dataclass
class LoraAdapter:
    name: str
    path: str
    weights: dict[tuple[int, str], LoraWeights]  # (layer, module in TARGET_MODULES) -> weights

    @property
    def max_rank(self) -> int:
        return max((w.rank for w in self.weights.values()), default=0)

    @property
    def targets(self) -> tuple[str, ...]:
        """The modules this adapter touches, in TARGET_MODULES (engine storage) order."""
        present = {m for _, m in self.weights}
        return tuple(m for m in TARGET_MODULES if m in present)

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({layer for layer, _ in self.weights}))

    @property
    def num_params(self) -> int:
        return sum(w.a.size + w.b.size for w in self.weights.values())

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.weights.values())


# --------------------------------------------------------------------------------------------------
# adapter_config.json: what we refuse


# Fields whose truthy value asks for something other than plain LoRA on linear projections.
_UNSUPPORTED_FIELDS = {
    "use_dora": "DoRA adapters are not supported (use_dora=true); merge DoRA into the base model instead",
    "fan_in_fan_out": "fan_in_fan_out=true is not supported (Llama projections are nn.Linear)",
    "modules_to_save": "modules_to_save is not supported: the adapter replaces whole base modules",
    "lora_bias": "lora_bias=true is not supported (LoRA B with a bias term)",
    "use_qalora": "use_qalora=true (QALoRA, GPTQ-only) is not supported",
    "layer_replication": "layer_replication is not supported: it changes the number of layers",
    "trainable_token_indices": "trainable_token_indices is not supported: it trains embedding rows",
    "target_parameters": "target_parameters is not supported: LoRA on raw parameters (MoE experts)",
    "alora_invocation_tokens": "Activated LoRA (alora_invocation_tokens) is not supported",
    "monteclora_config": "MonteCLoRA (monteclora_config) is not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
    "kasa_config": "KaSA (kasa_config) is not supported",
    "megatron_config": "Megatron-parallel LoRA (megatron_config) is not supported",
}

# init_lora_weights values for which PEFT rewrites the *base* weights when it loads the adapter, so the
# adapter is only correct on a residual base model we do not have.
_BASE_MUTATING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


def _check_supported(conf: dict) -> None:
    peft_type = conf.get("peft_type")
    if peft_type != "LORA":
        raise AdapterError(f"{CONFIG_FILE}: peft_type={peft_type!r} is not supported (only 'LORA')")
    for field, why in _UNSUPPORTED_FIELDS.items():
        if conf.get(field):
            raise AdapterError(f"{CONFIG_FILE}: {field}={conf[field]!r}: {why}")
    bias = conf.get("bias", "none")
    if bias != "none":
        raise AdapterError(f"{CONFIG_FILE}: bias={bias!r} is not supported (only 'none')")
    init = conf.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_MUTATING_INITS):
        raise AdapterError(
            f"{CONFIG_FILE}: init_lora_weights={init!r} modifies the base weights when PEFT loads it; "
            f"save the adapter with path_initial_model_for_weight_conversion to get a plain LoRA")
    _check_config_types(conf)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_config_types(conf: dict) -> None:
    r = conf.get("r", 8)
    if not _is_int(r) or r <= 0:
        raise AdapterError(f"{CONFIG_FILE}: r={r!r} must be a positive integer")
    if not _is_number(conf.get("lora_alpha", 8)):
        raise AdapterError(f"{CONFIG_FILE}: lora_alpha={conf.get('lora_alpha')!r} must be a finite number")
    if not isinstance(conf.get("use_rslora", False), bool):
        raise AdapterError(f"{CONFIG_FILE}: use_rslora={conf.get('use_rslora')!r} must be true or false")
    for field, check, what in (("rank_pattern", lambda v: _is_int(v) and v > 0, "a positive integer"),
                               ("alpha_pattern", _is_number, "a finite number")):
        pattern = conf.get(field) or {}
        if not isinstance(pattern, dict):
            raise AdapterError(f"{CONFIG_FILE}: {field}={pattern!r} must be a mapping of regex -> value")
        for key, value in pattern.items():
            _compile(key, f"{field}[{key!r}]")
            if not check(value):
                raise AdapterError(f"{CONFIG_FILE}: {field}[{key!r}]={value!r} must be {what}")


def _compile(pattern: str, field: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except (re.error, TypeError) as e:
        raise AdapterError(f"{CONFIG_FILE}: {field}={pattern!r} is not a valid regex: {e}") from None


# --------------------------------------------------------------------------------------------------
# adapter_config.json: which modules it targets, with which rank and alpha


@dataclasses.dataclass(frozen=True)
class _Target:
    module_name: str  # full PEFT module name, e.g. model.layers.0.self_attn.q_proj
    rank: int
    rank_field: str  # where the rank came from, for error messages: "r" or "rank_pattern['...']"
    scale: float


@functools.lru_cache(maxsize=8)
def _llama_module_names(num_layers: int) -> tuple[str, ...]:
    """`LlamaForCausalLM.named_modules()` names (root skipped, as PEFT skips it): what PEFT matches."""
    names = ["model", "model.embed_tokens", "model.layers"]
    for i in range(num_layers):
        p = f"model.layers.{i}"
        names += [p, f"{p}.self_attn", *(f"{p}.self_attn.{m}" for m in ATTN_MODULES),
                  f"{p}.mlp", *(f"{p}.mlp.{m}" for m in TARGET_MODULES if m not in ATTN_MODULES),
                  f"{p}.mlp.act_fn", f"{p}.input_layernorm", f"{p}.post_attention_layernorm"]
    return tuple(names + ["model.norm", "model.rotary_emb", "lm_head"])


_PROJECTION_RE = re.compile(r"model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)")


def _module_names_list(value: Any, field: str) -> list[str]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise AdapterError(f"{CONFIG_FILE}: {field}={value!r} must be a list of names or a regex string")
    return list(value)


def _layer_index(conf: dict, key: str) -> int | None:
    """The layer index PEFT reads from a module name for layers_to_transform (lazy: first index wins)."""
    pattern = conf.get("layers_pattern")
    if not pattern:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        m = None
        for p in [pattern] if isinstance(pattern, str) else pattern:
            m = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", key)
            if m:
                break
    return int(m.group("idx")) if m else None


def _is_targeted(conf: dict, targets: str | list[str], key: str) -> bool:
    """PEFT's check_target_module_exists (the modules_to_save branch is moot: we refuse those)."""
    exclude = conf.get("exclude_modules")
    if exclude:
        if isinstance(exclude, str):
            if re.fullmatch(exclude, key):
                return False
        elif key in exclude or any(key.endswith(f".{e}") for e in exclude):
            return False
    if isinstance(targets, str):
        return re.fullmatch(targets, key) is not None
    if key in targets:  # an exact full name skips the layers_to_transform filter, as in PEFT
        return True
    if not any(key.endswith(f".{t}") for t in targets):
        return False
    layers = conf.get("layers_to_transform")
    if layers is None or (isinstance(layers, list) and not layers):
        return True
    index = _layer_index(conf, key)
    if index is None:
        return False
    return index == layers if isinstance(layers, int) else index in layers


def _target_modules(conf: dict) -> str | list[str]:
    """target_modules as PEFT sees it after LoraConfig.__post_init__ and _prepare_adapter_config."""
    targets = conf.get("target_modules")
    layers, pattern = conf.get("layers_to_transform"), conf.get("layers_pattern")
    if targets is None:
        targets = list(DEFAULT_TARGET_MODULES)
    if isinstance(targets, str):
        # LoraConfig.__post_init__ forbids these with a string (regex or all-linear) target_modules.
        if layers is not None:
            raise AdapterError(f"{CONFIG_FILE}: layers_to_transform={layers!r} cannot be used when "
                               f"target_modules is a string ({targets!r})")
        if pattern is not None:
            raise AdapterError(f"{CONFIG_FILE}: layers_pattern={pattern!r} cannot be used when "
                               f"target_modules is a string ({targets!r})")
        if targets.lower() == ALL_LINEAR:
            return list(TARGET_MODULES)  # every nn.Linear except the output embedding (lm_head)
        _compile(targets, "target_modules")
        return targets
    targets = _module_names_list(targets, "target_modules")
    if pattern and layers is None:
        raise AdapterError(f"{CONFIG_FILE}: layers_pattern={pattern!r} needs layers_to_transform")
    if layers is not None and not (
            _is_int(layers) or (isinstance(layers, list) and all(map(_is_int, layers)))):
        raise AdapterError(f"{CONFIG_FILE}: layers_to_transform={layers!r} must be an int or a list of ints")
    if pattern:  # PEFT splices these into a regex unescaped
        for p in [pattern] if isinstance(pattern, str) else _module_names_list(pattern, "layers_pattern"):
            _compile(p, "layers_pattern")
    return targets


def _pattern_value(pattern: dict, key: str) -> tuple[str, Any] | None:
    """PEFT's get_pattern_key: the first pattern key matching the module name, and its value."""
    for pkey, value in pattern.items():
        if re.match(rf"(.*\.)?({pkey})$", key):
            return pkey, value
    return None


def _make_target(conf: dict, key: str) -> _Target:
    rank, rank_field = conf.get("r", 8), "r"
    alpha = conf.get("lora_alpha", 8)
    if hit := _pattern_value(conf.get("rank_pattern") or {}, key):
        rank_field, rank = f"rank_pattern[{hit[0]!r}]", hit[1]
    if hit := _pattern_value(conf.get("alpha_pattern") or {}, key):
        alpha = hit[1]
    scale = alpha / math.sqrt(rank) if conf.get("use_rslora", False) else alpha / rank
    return _Target(key, rank, rank_field, float(scale))


def _resolve_targets(conf: dict, cfg: ModelConfig) -> dict[tuple[int, str], _Target]:
    """(layer, module) -> rank/scale for every module the config targets on this model, PEFT's way.

    Refuses embed_tokens / lm_head and any non-linear module PEFT itself could not wrap."""
    targets = _target_modules(conf)
    shown = conf.get("target_modules")
    if exclude := conf.get("exclude_modules"):
        if isinstance(exclude, str):
            _compile(exclude, "exclude_modules")
        else:
            _module_names_list(exclude, "exclude_modules")
    found: dict[tuple[int, str], _Target] = {}
    for key in _llama_module_names(cfg.num_hidden_layers):
        if not _is_targeted(conf, targets, key):
            continue
        m = _PROJECTION_RE.fullmatch(key)
        if key in ("model.embed_tokens", "lm_head"):
            raise AdapterError(f"{CONFIG_FILE}: target_modules={shown!r} selects {key!r}: "
                               f"LoRA on embed_tokens / lm_head is not supported")
        if m is None or m.group(2) not in TARGET_MODULES:
            raise AdapterError(f"{CONFIG_FILE}: target_modules={shown!r} selects {key!r}, which is not "
                               f"a linear projection ({', '.join(TARGET_MODULES)})")
        found[(int(m.group(1)), m.group(2))] = _make_target(conf, key)
    if not found:
        raise AdapterError(
            f"{CONFIG_FILE}: target_modules={shown!r} (layers_to_transform="
            f"{conf.get('layers_to_transform')!r}, exclude_modules={conf.get('exclude_modules')!r}) "
            f"matches no projection of a {cfg.num_hidden_layers}-layer Llama model")
    return found


# --------------------------------------------------------------------------------------------------
# adapter_model.safetensors


# PEFT saves `base_model.model.<module>.lora_A.weight` (adapter name stripped); we also take the form
# with an adapter name (`lora_A.default.weight`) and keys without the `base_model.model.` prefix.
_KEY_RE = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)\."
    r"(?P<module>\w+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight")


def _read_config(path: Path) -> dict:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"{path}: no {CONFIG_FILE} (not a PEFT adapter directory)")
    try:
        conf = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{file}: not valid JSON: {e}") from None
    if not isinstance(conf, dict):
        raise AdapterError(f"{file}: expected a JSON object")
    return conf


def _weights_file(path: Path) -> Path:
    file = path / WEIGHTS_FILE
    if file.is_file():
        return file
    if (path / BIN_WEIGHTS_FILE).is_file():
        raise AdapterError(f"{path}: only {BIN_WEIGHTS_FILE} (a pickle) found; convert it to "
                           f"{WEIGHTS_FILE} (e.g. safetensors.torch.save_file(torch.load(...)))")
    raise AdapterError(f"{path}: no {WEIGHTS_FILE}")


def _read_tensors(file: Path) -> dict[str, np.ndarray]:
    try:
        with safe_open(str(file), framework="np") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise AdapterError(f"{file}: cannot read safetensors: {e}") from None


def _why_unknown(key: str) -> str:
    if "lora_magnitude_vector" in key:
        return f"tensor {key!r} is a DoRA magnitude vector (use_dora): DoRA is not supported"
    if "embed_tokens" in key or "lm_head" in key:
        return f"tensor {key!r}: LoRA on embed_tokens / lm_head is not supported"
    if "lora_" in key and key.endswith(".bias"):
        return f"tensor {key!r} is a LoRA bias (lora_bias): not supported"
    return (f"tensor {key!r} is not a lora_A/lora_B weight of a Llama projection "
            f"({', '.join(TARGET_MODULES)})")


def _group_pairs(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict[tuple[int, str], dict]:
    """(layer, module) -> {"A": (key, array), "B": (key, array)}, refusing every key we cannot place."""
    pairs: dict[tuple[int, str], dict] = {}
    for key, value in tensors.items():
        m = _KEY_RE.fullmatch(key)
        if m is None:
            raise AdapterError(f"{WEIGHTS_FILE}: {_why_unknown(key)}")
        module, parent, layer = m["module"], m["parent"], int(m["layer"])
        if module not in TARGET_MODULES or (parent == "self_attn") != (module in ATTN_MODULES):
            raise AdapterError(f"{WEIGHTS_FILE}: {_why_unknown(key)}")
        if layer >= cfg.num_hidden_layers:
            raise AdapterError(f"{WEIGHTS_FILE}: tensor {key!r} is for layer {layer}, but the base "
                               f"model has num_hidden_layers={cfg.num_hidden_layers}")
        slot = pairs.setdefault((layer, module), {})
        if m["ab"] in slot:
            raise AdapterError(f"{WEIGHTS_FILE}: duplicate lora_{m['ab']} tensors for layer {layer} "
                               f"{module}: {slot[m['ab']][0]!r} and {key!r}")
        slot[m["ab"]] = (key, value)
    return pairs


def _check_pair(pair: dict, target: _Target, cfg: ModelConfig, module: str) -> None:
    """Both halves present, shapes fit the base projection, float dtype, rank agrees with the config."""
    for ab, other in (("A", "B"), ("B", "A")):
        if ab not in pair:
            raise AdapterError(f"{WEIGHTS_FILE}: {pair[other][0]!r} has no matching lora_{ab} tensor")
    (a_key, a), (b_key, b) = pair["A"], pair["B"]
    in_f, out_f = cfg.module_shape(module)
    if a.ndim != 2 or a.shape[1] != in_f:  # PEFT's lora_A.weight is [r, in_features]
        raise AdapterError(f"{WEIGHTS_FILE}: tensor {a_key!r} has shape {list(a.shape)}, expected "
                           f"[r, {in_f}] for {module} of the base model")
    if b.ndim != 2 or b.shape[0] != out_f:  # PEFT's lora_B.weight is [out_features, r]
        raise AdapterError(f"{WEIGHTS_FILE}: tensor {b_key!r} has shape {list(b.shape)}, expected "
                           f"[{out_f}, r] for {module} of the base model")
    for key, arr, rank in ((a_key, a, a.shape[0]), (b_key, b, b.shape[1])):
        if arr.dtype not in _SOURCE_DTYPES:
            raise AdapterError(f"{WEIGHTS_FILE}: tensor {key!r} has dtype {arr.dtype}; "
                               f"expected a float type (float32, float16, bfloat16)")
        if rank != target.rank:
            raise AdapterError(f"{WEIGHTS_FILE}: tensor {key!r} has rank {rank}, but {CONFIG_FILE} "
                               f"gives {target.rank_field}={target.rank} for {target.module_name}")


def _all_finite(arr: np.ndarray) -> bool:
    if arr.dtype == _SERVE_DTYPES["bfloat16"]:  # exponent bits all ones: Inf or NaN (no float32 copy)
        return not np.any((arr.view(np.uint16) & 0x7F80) == 0x7F80)
    return bool(np.isfinite(arr).all())


def _convert(key: str, arr: np.ndarray, dtype: np.dtype | None) -> np.ndarray:
    """Cast (None: keep the file's dtype, a float of _SOURCE_DTYPES other than float64), refuse
    what would poison every output, and transpose PEFT's layout to ours as a view (no copy:
    pack_adapter reads A back in the file's order and transposes B once)."""
    if dtype is None:
        dtype = np.dtype(np.float32) if arr.dtype == np.float64 else arr.dtype
    with np.errstate(over="ignore"):  # overflow is caught just below, with the tensor's name
        out = arr.astype(dtype, copy=False)  # cast in the file's (contiguous) order: fast
    if not _all_finite(out):
        raise AdapterError(f"{WEIGHTS_FILE}: tensor {key!r} has non-finite values as {dtype} "
                           f"(NaN/Inf in the file, or overflow in the conversion)")
    return out.T


def _serve_dtype(dtype: Any) -> np.dtype:
    try:
        d = _SERVE_DTYPES[dtype] if isinstance(dtype, str) else np.dtype(dtype)
    except (KeyError, TypeError):
        d = None
    if d not in _SERVE_DTYPES.values():
        raise AdapterError(f"dtype={dtype!r} is not supported ({', '.join(_SERVE_DTYPES)})")
    return d


# --------------------------------------------------------------------------------------------------
# public API


def load_peft_adapter(path: str | os.PathLike, cfg: ModelConfig, *, name: str | None = None,
                      max_rank: int | None = None, dtype: Any = np.float32) -> LoraAdapter:
    """Load a PEFT LoRA adapter directory for the base model `cfg`; AdapterError if it cannot be served.
    dtype: the weights' dtype (None: the file's own, float64 as float32; pack_adapter then casts
    once into the pool's dtype)."""
    path = Path(path)
    out_dtype = None if dtype is None else _serve_dtype(dtype)
    if not path.is_dir():
        raise AdapterError(f"{path}: adapter directory not found")
    conf = _read_config(path)
    weights_file = _weights_file(path)
    _check_supported(conf)
    targets = _resolve_targets(conf, cfg)
    if max_rank is not None:
        for t in targets.values():
            if t.rank > max_rank:
                raise AdapterError(f"{CONFIG_FILE}: {t.rank_field}={t.rank} for {t.module_name} "
                                   f"exceeds max_rank={max_rank}")

    pairs = _group_pairs(_read_tensors(weights_file), cfg)
    for (layer, module), pair in pairs.items():
        if (layer, module) not in targets:
            key = next(iter(pair.values()))[0]
            raise AdapterError(f"{WEIGHTS_FILE}: tensor {key!r} is for a module that target_modules="
                               f"{conf.get('target_modules')!r} does not select")
    weights = {}
    for (layer, module), target in sorted(targets.items(), key=lambda kv: _order(kv[0])):
        pair = pairs.get((layer, module))
        if pair is None:
            raise AdapterError(f"{WEIGHTS_FILE}: target_modules selects {target.module_name}, but it has "
                               f"no lora_A / lora_B tensors")
        _check_pair(pair, target, cfg, module)
        weights[(layer, module)] = LoraWeights(a=_convert(*pair["A"], out_dtype),
                                               b=_convert(*pair["B"], out_dtype), scale=target.scale)
    return LoraAdapter(name=name or path.resolve().name, path=str(path), weights=weights)


def _order(key: tuple[int, str]) -> tuple[int, int]:
    return key[0], TARGET_MODULES.index(key[1])


def _config_json(adapter_config: dict) -> str:
    return json.dumps(adapter_config, indent=2, sort_keys=True) + "\n"  # as PeftConfig.save_pretrained


def save_peft_adapter(path: str | os.PathLike, adapter_config: dict,
                      tensors: dict[str, np.ndarray]) -> None:
    """Write a PEFT adapter directory (config as given, tensors as given) the way PEFT lays it out."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(_config_json(adapter_config))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path / WEIGHTS_FILE),
              metadata={"format": "pt"})  # PEFT writes the same metadata


def peft_tensor_key(layer: int, module: str, ab: str) -> str:
    """The safetensors key PEFT writes for `lora_A` / `lora_B` of one projection."""
    parent = "self_attn" if module in ATTN_MODULES else "mlp"
    return f"base_model.model.model.layers.{layer}.{parent}.{module}.lora_{ab}.weight"


def random_peft_adapter(path: str | os.PathLike, cfg: ModelConfig, *, rank: int,
                        targets: str | Iterable[str] = ALL_LINEAR, alpha: float | None = None,
                        seed: int = 0, use_rslora: bool = False, rank_pattern: dict | None = None,
                        alpha_pattern: dict | None = None,
                        layers_to_transform: int | list[int] | None = None, std: float = 0.05,
                        dtype: Any = np.float32) -> str:
    """Write a real PEFT-format adapter with random A and B (never all-zero); return its path.

    alpha defaults to 2 * rank so that scale != 1 (a forgotten scale shows up in parity tests)."""
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None,
        "r": rank, "lora_alpha": 2 * rank if alpha is None else alpha, "lora_dropout": 0.0,
        "target_modules": targets if isinstance(targets, str) else list(targets),
        "bias": "none", "use_rslora": use_rslora, "use_dora": False, "fan_in_fan_out": False,
        "modules_to_save": None, "init_lora_weights": True, "inference_mode": True,
        "rank_pattern": dict(rank_pattern or {}), "alpha_pattern": dict(alpha_pattern or {}),
        "layers_to_transform": layers_to_transform, "layers_pattern": None, "exclude_modules": None,
    }
    # Resolve ranks from the config as it will read back: PEFT saves with sort_keys=True, which reorders
    # rank_pattern / alpha_pattern, and their first-match-wins lookup depends on that order.
    config = json.loads(_config_json(config))
    rng = np.random.default_rng(seed)
    tensors = {}
    targets = _resolve_targets(config, cfg)
    for layer, module in sorted(targets, key=_order):
        target = targets[(layer, module)]
        in_f, out_f = cfg.module_shape(module)
        tensors[peft_tensor_key(layer, module, "A")] = rng.standard_normal((target.rank, in_f)) * std
        tensors[peft_tensor_key(layer, module, "B")] = rng.standard_normal((out_f, target.rank)) * std
    tensors = {k: v.astype(_serve_dtype(dtype)) for k, v in tensors.items()}
    if any(not v.any() for v in tensors.values()):  # an all-zero B would make the adapter a no-op
        raise ValueError(f"std={std} underflows to all-zero weights in {dtype}")
    save_peft_adapter(path, config, tensors)
    return str(path)
