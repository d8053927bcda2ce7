"""Kernel settings as frozen dataclasses, tuned values as data per device kind.

Each kernel family keeps a JSON file in its configs/ folder, keyed by `jax.Device.device_kind`
(e.g. "NVIDIA H200"); `load_tuned` reads one device's entry, and a device with no entry gets the
dataclass defaults. The dataclasses are hashable, so the kernels take them as static arguments
(`block_sizes=`): a different setting is a different compiled kernel, and nothing global changes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path


def device_kind(device_kind: str | None = None) -> str:
    """device_kind as given, or the first JAX device's."""
    if device_kind is not None:
        return device_kind
    import jax
    return jax.devices()[0].device_kind


@functools.lru_cache(maxsize=None)
def _table(path: str) -> dict:
    return json.loads(Path(path).read_text())


def load_tuned(path: Path, device_kind: str) -> dict:
    """The entry of `device_kind` in the JSON table at `path` ({} when the device has none)."""
    return dict(_table(str(path)).get(device_kind, {}))


def from_dict(cls, values: dict):
    """cls(**values), refusing names the dataclass does not have (a typo in a config or a flag)."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - names
    if unknown:
        raise ValueError(f"{cls.__name__} has no setting {sorted(unknown)}; it has {sorted(names)}")
    return cls(**values)
