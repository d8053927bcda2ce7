"""Host adapter store: thousands of registered adapters, loaded lazily, a bounded host cache.

Registering validates the adapter in full (so a bad one fails at load time and nothing changes),
keeps its page layout, and caches its packed rows. Only `host_cache_size` weight files keep their
rows in host memory; the rest are re-read from disk on demand. The cache is keyed by the weight
file's identity (path, size, mtime), so one directory registered under many names is read once.
Each (re-)registration bumps a version: the pool keys pages by (name, version), so a replaced
adapter's stale pages are never served.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
from pathlib import Path

import jax
import numpy as np

from slora_jax.adapters import load_peft_adapter
from slora_jax.config import ModelConfig
from slora_jax.layout import AdapterLayout, pack_adapter


@dataclasses.dataclass(frozen=True)
class AdapterEntry:
    name: str
    path: str
    version: int
    layout: AdapterLayout
    file_id: tuple

    @functools.cached_property  # read for every token of every step: built once
    def key(self) -> tuple[str, int]:
        return (self.name, self.version)


def _file_id(path) -> tuple:
    """Identity of an adapter's weights on disk. ctime is in it because a rewrite that keeps size
    and mtime (cp -p, rsync -t) still changes ctime, which no user can set."""
    f = Path(path) / "adapter_model.safetensors"
    st = f.stat() if f.is_file() else None
    stamp = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) if st else None
    return (str(Path(path).resolve()), stamp)


def _pinned_host(x: np.ndarray):
    """Stage host rows in pinned memory where the platform has it, so host->device copies run at
    full PCIe speed and asynchronously; plain numpy elsewhere (CPU)."""
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return x
    try:
        sharding = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
        return jax.device_put(x, sharding)
    except (ValueError, RuntimeError):
        return x


class AdapterStore:
    def __init__(self, cfg: ModelConfig, dtype, page_size: int, max_rank: int, host_cache_size: int = 256,
                 *, pad_to_max_rank: bool = False):
        self.cfg, self.dtype, self.page_size, self.max_rank = cfg, dtype, page_size, max_rank
        # Lay every adapter out at max_rank on every target module (the padded-slots baseline).
        self.pad_rank = max_rank if pad_to_max_rank else None
        self.host_cache_size = host_cache_size
        self.entries: dict[str, AdapterEntry] = {}
        self._rows: collections.OrderedDict[tuple, object] = collections.OrderedDict()
        self._version = 0
        self.disk_loads = 0

    def register(self, name: str, path: str | os.PathLike) -> AdapterEntry:
        """Validate and register; re-registering a name always reads its files again."""
        fid = _file_id(path)
        known = next((e for e in self.entries.values()
                      if e.file_id == fid and e.name != name and fid in self._rows), None)
        if known is not None:
            layout = known.layout
        else:
            adapter = load_peft_adapter(path, self.cfg, name=name, max_rank=self.max_rank)  # may raise
            layout = AdapterLayout.of(adapter, self.cfg, self.page_size, self.pad_rank)
            self._cache(fid, pack_adapter(adapter, layout, self.cfg, self.dtype))
        self._version += 1
        entry = AdapterEntry(name, str(path), self._version, layout, fid)
        self.entries[name] = entry
        return entry

    def unregister(self, name: str) -> AdapterEntry:
        return self.entries.pop(name)

    def get(self, name: str) -> AdapterEntry:
        return self.entries[name]

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def rows(self, entry: AdapterEntry):
        """Packed rows [L, rows, W] for the adapter version `entry`, from cache or disk."""
        if entry.file_id in self._rows:
            self._rows.move_to_end(entry.file_id)
            return self._rows[entry.file_id]
        adapter = load_peft_adapter(entry.path, self.cfg, name=entry.name, max_rank=self.max_rank)
        if AdapterLayout.of(adapter, self.cfg, self.page_size, self.pad_rank) != entry.layout:
            raise RuntimeError(f"adapter {entry.name!r} changed on disk since it was registered; "
                               "register it again")
        self.disk_loads += 1
        return self._cache(entry.file_id, pack_adapter(adapter, entry.layout, self.cfg, self.dtype))

    def _cache(self, key, rows: np.ndarray):
        staged = _pinned_host(rows)
        self._rows[key] = staged
        while len(self._rows) > self.host_cache_size:
            self._rows.popitem(last=False)
        return staged
