"""Tensor parallelism (docs/ARCHITECTURE.md, "Tensor parallelism"): one mesh axis, "tp", over N devices.

- Base weights, Megatron style: q, k, v, gate and up split on their outputs (column-parallel), o
  and down on their inputs (row-parallel, their partial outputs summed across the axis).
  Embeddings, norms and the LM head are replicated, so every device samples the same tokens.
- The pool is split along its row width (W, one K/V vector): each device holds its own K/V heads,
  and a slice of every adapter row.
- Adapters, S-LoRA's layout: A split on its input and B on its output on every module. A device
  shrinks its slice of x (a column-parallel layer's x is whole on every device: it takes its slice;
  a row-parallel layer's x is already its slice), the partial x·A [T, r] is summed across the axis
  (small), and the device expands into its slice of y (a row-parallel layer's y is the full-width
  partial sum: the delta goes into the device's columns before the base sum, once).
- `pack_adapter` lays each A^T / B out so that device d's columns of the adapter's rows hold, in
  row-major order, exactly its slice: the kernels then see an ordinary adapter of fin / N inputs
  and fout / N outputs in rows of W / N.

`TP` is the static context a jitted step carries: the mesh, its size and the axis name.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from slora_jax.model.config import ModelConfig, projection_of

AXIS = "tp"
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class TP:
    mesh: Mesh

    @property
    def size(self) -> int:
        return self.mesh.shape[AXIS]

    @staticmethod
    def make(size: int, cfg: ModelConfig) -> "TP":
        """A mesh of the first `size` devices, after checking that cfg splits evenly over them."""
        check(cfg, size)
        devices = jax.devices()
        if size > len(devices):
            raise ValueError(f"tensor_parallel={size} needs {size} devices, {jax.default_backend()} has "
                             f"{len(devices)}")
        return TP(Mesh(np.array(devices[:size]), (AXIS,)))

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)


def psum(x: jax.Array) -> jax.Array:
    """The sum of x across the devices (inside shard_map over the mesh)."""
    return jax.lax.psum(x, AXIS)


def check(cfg: ModelConfig, size: int) -> None:
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel must be a positive integer, got {size!r}")
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "hidden_size"):
        if getattr(cfg, name) % size:
            raise ValueError(f"tensor_parallel={size} does not divide {cfg.name}'s {name} "
                             f"({getattr(cfg, name)})")


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The shapes one device computes: its heads, K/V heads and MLP columns (hidden stays whole)."""
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // size,
                               num_key_value_heads=cfg.num_key_value_heads // size,
                               intermediate_size=cfg.intermediate_size // size, head_dim=cfg.head_dim)


def param_specs(params) -> dict:
    """PartitionSpecs of a params tree (model.Params): weights are [out, in] (HF layout)."""
    def layer(p: dict) -> dict:  # a bias or int8 scales: split with a column module's outputs, whole
        # beside a row module (its scales multiply the devices' partial sums alike)
        return {k: P(AXIS, None) if k in COLUMN else P(None, AXIS) if k in ROW else
                P(AXIS) if projection_of(k) in COLUMN else P() for k in p}
    return {k: [layer(p) for p in v] if k == "layers" else P() for k, v in params.items()}


POOL = P(None, None, None, AXIS)   # a layer's pool [pages, 2, page_size, W]: split along W
ROWS = P(None, None, AXIS)         # an adapter's packed rows [L, n, W], as they are scattered in
KV = P(None, AXIS, None)           # a step's new K or V [T, kv_heads, head_dim]
REPLICATED = P()                   # every device holds the whole array (step inputs, results)


def shard_params(params, tp: TP):
    """The params placed on the mesh (column / row splits, the rest replicated)."""
    specs = param_specs(params)
    put = lambda x, s: jax.device_put(x, tp.sharding(s))  # noqa: E731
    return {k: [{m: put(w, specs[k][i][m]) for m, w in p.items()} for i, p in enumerate(v)] if k == "layers"
            else put(v, specs[k]) for k, v in params.items()}


def split_columns(mat: np.ndarray, rows: int, width: int, size: int, whole_rows: bool = False) -> np.ndarray:
    """mat [r, f] as `rows` pool rows [rows, width] in which device d's columns (a block of
    width / size) hold mat[:, its f / size slice] flattened row-major: the layout the kernels read
    on each device. size 1: mat flattened into rows, the single-device layout. whole_rows: each
    rank row of a device's slice padded with zeros to whole rows of its columns (layout.py)."""
    r, f = mat.shape
    fl, wl = f // size, width // size
    cols = -(-fl // wl) * wl if whole_rows else fl  # a device's columns per rank row
    out = np.zeros((size, rows * wl), mat.dtype)
    for d in range(size):
        part = out[d, :r * cols].reshape(r, cols)
        part[:, :fl] = mat[:, d * fl:(d + 1) * fl]
    return out.reshape(size, rows, wl).transpose(1, 0, 2).reshape(rows, width)
