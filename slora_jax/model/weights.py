"""Base-model weights: Hugging Face safetensors in and out, dummy weights from a seed, an orbax cache.

The params pytree (HF layout, linear weights are [out_features, in_features]):

    {"embed_tokens": [V, H],
     "layers": [{"input_layernorm": [H], "q_proj": [q, H], "k_proj": [kv, H], "v_proj": [kv, H],
                 "o_proj": [H, q], "post_attention_layernorm": [H],
                 "gate_proj": [I, H], "up_proj": [I, H], "down_proj": [H, I]}, ...],   # a Python list
     "norm": [H],
     "lm_head": [V, H]}        # absent when cfg.tie_word_embeddings

Entry point: `load_params(model, cfg, dtype, seed=..., cache_dir=...)`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from slora_jax.model.config import ATTN_MODULES, BIAS, MLP_MODULES, QKV_MODULES, ModelConfig, bias_key

Params = dict[str, Any]
TreePath = tuple[str | int, ...]

DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}

# safetensors dtype tags. BF16 goes through ml_dtypes (a jax dependency), so reading does not
# depend on whether the installed safetensors' numpy backend knows bfloat16.
_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tensors some checkpoints carry that the engine recomputes itself.
_HARMLESS_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
_BIG_MODEL_PARAMS = 100_000_000  # dummy_params shows a progress bar above this


def as_dtype(dtype) -> np.dtype:
    """"bfloat16" | "float16" | "float32" or a jnp/np dtype -> np.dtype."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported ({', '.join(DTYPES)})")
        return np.dtype(DTYPES[dtype])
    dt = np.dtype(dtype)
    if dt.name not in DTYPES:
        raise ValueError(f"dtype {dt.name!r} is not supported ({', '.join(DTYPES)})")
    return dt


# ----------------------------------------------------------------------------------------------
# Names and paths


def hf_names(cfg: ModelConfig) -> dict[str, tuple[TreePath, tuple[int, ...]]]:
    """HF tensor name -> (path into the params pytree, expected shape), in checkpoint order."""
    h, v = cfg.hidden_size, cfg.vocab_size
    proj = {name: cfg.module_shape(name)[::-1] for name in ATTN_MODULES + MLP_MODULES}  # [out, in]
    names: dict[str, tuple[TreePath, tuple[int, ...]]] = {
        "model.embed_tokens.weight": (("embed_tokens",), (v, h))}
    for layer in range(cfg.num_hidden_layers):
        pre = f"model.layers.{layer}."
        names[pre + "input_layernorm.weight"] = (("layers", layer, "input_layernorm"), (h,))
        for m in ATTN_MODULES:
            names[pre + f"self_attn.{m}.weight"] = (("layers", layer, m), proj[m])
            if m in cfg.bias_modules:
                names[pre + f"self_attn.{m}.bias"] = (("layers", layer, bias_key(m)), proj[m][:1])
        for norm in QK_NORMS if cfg.qk_norm else ():
            names[pre + f"self_attn.{norm}.weight"] = (("layers", layer, norm), (cfg.head_dim,))
        names[pre + "post_attention_layernorm.weight"] = (("layers", layer, "post_attention_layernorm"), (h,))
        for m in MLP_MODULES:
            names[pre + f"mlp.{m}.weight"] = (("layers", layer, m), proj[m])
            if m in cfg.bias_modules:
                names[pre + f"mlp.{m}.bias"] = (("layers", layer, bias_key(m)), proj[m][:1])
    names["model.norm.weight"] = (("norm",), (h,))
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = (("lm_head",), (v, h))
    return names


QK_NORMS = ("q_norm", "k_norm")  # Qwen3's per-head norms (ModelConfig.qk_norm)


def _empty_tree(cfg: ModelConfig) -> Params:
    """The pytree skeleton with None leaves; filled leaf by leaf so only one tensor is in flight."""
    layer_keys = ("input_layernorm", *ATTN_MODULES, "post_attention_layernorm", *MLP_MODULES,
                  *map(bias_key, cfg.bias_modules), *(QK_NORMS if cfg.qk_norm else ()))
    tree: Params = {"embed_tokens": None,
                    "layers": [dict.fromkeys(layer_keys) for _ in range(cfg.num_hidden_layers)],
                    "norm": None}
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = None
    return tree


def _get(tree, path: TreePath):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree, path: TreePath, value) -> None:
    _get(tree, path[:-1])[path[-1]] = value


# ----------------------------------------------------------------------------------------------
# Reading safetensors


class _SafetensorsFile:
    """A safetensors file read through its JSON header, one tensor at a time into a fresh buffer.

    Parsing the header ourselves keeps BF16 independent of the safetensors version (ml_dtypes
    supplies the numpy dtype), and reading with readinto (not a memmap) keeps host memory at one
    tensor: nothing of the file stays mapped into the process.
    """

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        self.header = header
        self.data_start = 8 + n

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def nbytes(self, name: str) -> int:
        begin, end = self.header[name]["data_offsets"]
        return end - begin

    def read(self, name: str, f) -> np.ndarray:
        """The tensor as an owned host array; f is this file opened for binary reading."""
        info = self.header[name]
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        buf = np.empty(end - begin, np.uint8)
        f.seek(self.data_start + begin)
        if f.readinto(buf) != buf.size:
            raise ValueError(f"{self.path}: tensor {name!r} is truncated")
        return buf.view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file that holds it (sharded index, single file, or a glob)."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {f: model_dir / f for f in set(weight_map.values())}
        for f, p in files.items():
            if not p.is_file():
                raise ValueError(f"{index} names shard {f!r}, which does not exist")
        return {name: files[f] for name, f in weight_map.items()}
    paths = [model_dir / SINGLE_FILE] if (model_dir / SINGLE_FILE).is_file() else sorted(
        p for p in model_dir.glob("*.safetensors") if not p.name.startswith("adapter_"))
    if not paths:
        others = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        found = f" (found {', '.join(others)})" if others else ""
        raise ValueError(
            f"no safetensors weights in {model_dir}{found}: expected {SINGLE_FILE} or {INDEX_FILE}. "
            "PyTorch .bin checkpoints must be converted to safetensors first, e.g. "
            "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out, safe_serialization=True)")
    where: dict[str, Path] = {}
    for p in paths:
        where.update(dict.fromkeys(_SafetensorsFile(p).header, p))
    return where


def _check_names(where: dict[str, Path], expected: dict, model_dir: Path, cfg: ModelConfig) -> None:
    missing = [n for n in expected if n not in where]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"{model_dir}: tensor(s) missing from the checkpoint: "
                         f"{', '.join(missing[:5])}{more}")
    tied_head = {"lm_head.weight"} if cfg.tie_word_embeddings else set()  # tied: the head is the embedding
    unexpected = [n for n in where if n not in expected and n not in tied_head
                  and not n.endswith(_HARMLESS_SUFFIXES)]
    if unexpected:
        # Loud on purpose: an unknown tensor (a bias, an extra layer) means outputs would be wrong.
        raise ValueError(f"{model_dir}: unexpected tensor(s) for {cfg.num_hidden_layers}-layer Llama config: "
                         f"{', '.join(unexpected[:5])}")


def _to_host(x: jax.Array) -> np.ndarray:
    # np.asarray(x) caches the host copy on x itself, which would keep a second copy of the
    # whole model on the host for as long as params live; fetch through a throwaway copy.
    return np.asarray(jnp.array(x, copy=True))


def _to_device(host: np.ndarray, dtype: np.dtype) -> jax.Array:
    x = jax.device_put(host)
    if x.dtype != dtype:
        x = x.astype(dtype)  # cast on the device: one tensor in flight, and the same rounding as jnp
    return x.block_until_ready()  # bounded host memory: the host copy is freed before the next one


def load_hf_weights(model_dir: str | os.PathLike, cfg: ModelConfig, dtype="bfloat16") -> Params:
    """Load a HF Llama checkpoint (model.safetensors or a sharded index) into the params pytree."""
    model_dir, dtype = Path(model_dir), as_dtype(dtype)
    expected = hf_names(cfg)
    where = _weight_files(model_dir)
    _check_names(where, expected, model_dir, cfg)

    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(where[name], []).append(name)
    files = {p: _SafetensorsFile(p) for p in by_file}
    for p, names in by_file.items():  # all shapes first: fail before spending minutes on transfers
        for name in names:
            if files[p].shape(name) != expected[name][1]:
                raise ValueError(f"{p}: tensor {name!r} has shape {files[p].shape(name)}, "
                                 f"expected {expected[name][1]} for config {cfg.name!r}")

    params = _empty_tree(cfg)
    total = sum(files[p].nbytes(n) for p, names in by_file.items() for n in names)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {model_dir.name}") as bar:
        for p, names in sorted(by_file.items()):
            f = files[p]
            names.sort(key=lambda n: f.header[n]["data_offsets"][0])  # sequential reads
            with open(p, "rb") as fh:
                for name in names:
                    _set(params, expected[name][0], _to_device(f.read(name, fh), dtype))
                    bar.update(f.nbytes(name))
    return params


# ----------------------------------------------------------------------------------------------
# Writing safetensors + config.json


def hf_config_dict(cfg: ModelConfig, dtype: str = "float32") -> dict:
    """ModelConfig in Hugging Face LlamaConfig names."""
    eos = cfg.eos_token_id
    qwen2 = set(cfg.bias_modules) == set(QKV_MODULES)  # Llama's flags cannot say q, k, v only
    if (qwen2 and cfg.qk_norm) or (not qwen2 and cfg.bias_modules and set(cfg.bias_modules) not in (
            set(ATTN_MODULES), set(MLP_MODULES), set(ATTN_MODULES + MLP_MODULES))):
        raise ValueError(f"bias_modules {cfg.bias_modules}, qk_norm {cfg.qk_norm}: no Hugging Face config says that")
    arch = "qwen3" if cfg.qk_norm else "qwen2" if qwen2 else "llama"
    return {
        "architectures": [{"qwen3": "Qwen3", "qwen2": "Qwen2", "llama": "Llama"}[arch] + "ForCausalLM"],
        "model_type": arch, "hidden_act": "silu",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": list(eos) if isinstance(eos, tuple) else eos,
        "attention_bias": not qwen2 and "o_proj" in cfg.bias_modules,
        "mlp_bias": "down_proj" in cfg.bias_modules, "torch_dtype": dtype,
        **({"sliding_window": cfg.sliding_window} if cfg.sliding_window is not None else {}),
    }


def _plan_shards(sizes: dict[str, int], max_shard_bytes: int | None) -> list[list[str]]:
    """Greedy split in checkpoint order; a tensor larger than the limit gets a shard of its own."""
    if max_shard_bytes is None:
        return [list(sizes)]
    shards: list[list[str]] = [[]]
    used = 0
    for name, n in sizes.items():
        if shards[-1] and used + n > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += n
    return shards


def save_hf_weights(params: Params, cfg: ModelConfig, model_dir: str | os.PathLike,
                    max_shard_bytes: int | None = None) -> None:
    """Write params as a HF checkpoint: safetensors (sharded + index when max_shard_bytes) and config.json.

    One shard is on the host at a time (without max_shard_bytes, that is the whole model).
    """
    from safetensors.numpy import save_file

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    names = hf_names(cfg)
    sizes = {n: math.prod(shape) * _get(params, path).dtype.itemsize for n, (path, shape) in names.items()}
    shards = _plan_shards(sizes, max_shard_bytes)
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = SINGLE_FILE if len(shards) == 1 and max_shard_bytes is None else \
            f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        # "pt" metadata because transformers refuses safetensors files without a known format.
        tensors = {n: _to_host(_get(params, names[n][0])) for n in shard}
        save_file(tensors, model_dir / fname, metadata={"format": "pt"})
        del tensors
        weight_map.update(dict.fromkeys(shard, fname))
    if max_shard_bytes is not None:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (model_dir / INDEX_FILE).write_text(json.dumps(index, indent=2))
    dtype = np.dtype(params["embed_tokens"].dtype).name
    (model_dir / "config.json").write_text(json.dumps(hf_config_dict(cfg, dtype), indent=2))


# ----------------------------------------------------------------------------------------------
# Dummy weights


@functools.partial(jax.jit, static_argnames=("size",))
def _random_flat(key, mean, std, *, size):
    # Keyed on the flat size alone: the expensive compile (the RNG) is shared by every shape of
    # that size and every dtype; the reshape and cast outside are cheap to compile.
    return mean + std * jax.random.normal(key, (size,), jnp.float32)


def _leaf_stats(path: TreePath, shape: tuple[int, ...], cfg: ModelConfig) -> tuple[float, float]:
    """(mean, std) for a dummy leaf.

    Matrices get std 1/sqrt(in_features): with the pre-norms every projection output keeps unit
    scale, the residual stream grows only like sqrt(layers), and the logits come out with std ~1
    (finite, not peaked) at any depth and in bf16. Norm weights are 1 + noise so they matter.
    """
    if path[-1].endswith(BIAS):
        return 0.0, 0.1
    if len(shape) == 1:
        return 1.0, 0.1
    fan_in = cfg.hidden_size if path[-1] == "embed_tokens" else shape[1]
    return 0.0, 1.0 / math.sqrt(fan_in)


def dummy_params(cfg: ModelConfig, dtype="bfloat16", seed: int = 0) -> Params:
    """Random weights from a seed, generated on the device leaf by leaf.

    Leaf k (in hf_names order) draws from fold_in(key(seed), k) in float32 and is then cast, so
    its values depend only on the seed and its position, and a bf16 dummy model is exactly the
    cast of the fp32 one (threefry: the same numbers on CPU and GPU).
    """
    dtype = as_dtype(dtype)
    root = jax.random.key(seed)
    params = _empty_tree(cfg)
    names = hf_names(cfg)
    quiet = cfg.num_params() < _BIG_MODEL_PARAMS
    for k, (path, shape) in enumerate(tqdm(names.values(), desc=f"dummy weights {cfg.name}", disable=quiet)):
        mean, std = _leaf_stats(path, shape, cfg)
        flat = _random_flat(jax.random.fold_in(root, k), mean, std, size=math.prod(shape))
        _set(params, path, flat.reshape(shape).astype(dtype).block_until_ready())  # block: honest bar
    return params


# ----------------------------------------------------------------------------------------------
# Orbax cache


def _abstract_params(cfg: ModelConfig, dtype) -> Params:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    tree = _empty_tree(cfg)
    for path, shape in hf_names(cfg).values():
        _set(tree, path, jax.ShapeDtypeStruct(shape, as_dtype(dtype), sharding=sharding))
    return tree


def _trim_host_memory() -> None:
    # glibc keeps the freed staging buffers of a checkpoint in its arenas; hand them back.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def save_params(params: Params, ckpt_dir: str | os.PathLike) -> None:
    """Save the converted pytree with orbax (atomic: a partial save never looks complete).

    With orbax's defaults the process keeps host memory of more than the weights' size after the
    save, part of it tied to the saved arrays for as long as they live. Saving throwaway
    device copies, staged through unpinned host memory, then trimming, returns the process to
    its baseline. The price is one transient extra copy of the weights on the device.
    """
    import orbax.checkpoint as ocp

    copies = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
    handler = ocp.PyTreeCheckpointHandler(enable_pinned_host_transfer=False)
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(Path(ckpt_dir).resolve(), args=ocp.args.PyTreeSave(copies), force=True)
    del copies
    _trim_host_memory()


def restore_params(ckpt_dir: str | os.PathLike, cfg: ModelConfig, dtype="bfloat16") -> Params:
    """Restore a pytree saved by save_params onto the default device, in dtype."""
    import orbax.checkpoint as ocp

    target = _abstract_params(cfg, dtype)
    # Bound the bytes in flight: with orbax's default the host's peak exceeds the weights' size.
    # The bound is at least the largest leaf.
    largest = max(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(target))
    handler = ocp.PyTreeCheckpointHandler(restore_concurrent_gb=max(4, math.ceil(largest / 1e9)))
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)  # places leaves on the device
    args = ocp.args.PyTreeRestore(item=target, restore_args=restore_args)
    with ocp.Checkpointer(handler) as ckptr:
        params = ckptr.restore(Path(ckpt_dir).resolve(), args=args)
    _trim_host_memory()
    return params


def cache_key(model_dir: str | os.PathLike, cfg: ModelConfig, dtype) -> str:
    """Names a converted checkpoint: the model dir, its files' sizes and mtimes, the config and dtype.

    Rewriting the checkpoint changes the key, so a stale conversion is never restored.
    """
    model_dir = Path(model_dir).resolve()
    h = hashlib.sha256(f"{model_dir}\n{cfg!r}".encode())
    for p in sorted([*model_dir.glob("*.safetensors*"), model_dir / "config.json"]):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return f"{model_dir.name}-{as_dtype(dtype).name}-{h.hexdigest()[:16]}"


def load_params(model: str | os.PathLike, cfg: ModelConfig, dtype="bfloat16", *, seed: int = 0,
                cache_dir: str | os.PathLike | None = None) -> Params:
    """The one entry point: a HF model directory (through the orbax cache if given) or dummy weights."""
    if isinstance(model, ModelConfig) or not Path(model).is_dir():
        return dummy_params(cfg, dtype, seed)  # a shape name from configs/models, or a ModelConfig
    if cache_dir is None:
        return load_hf_weights(model, cfg, dtype)
    ckpt = Path(cache_dir) / cache_key(model, cfg, dtype)
    if ckpt.is_dir():
        return restore_params(ckpt, cfg, dtype)
    params = load_hf_weights(model, cfg, dtype)
    save_params(params, ckpt)
    return params
