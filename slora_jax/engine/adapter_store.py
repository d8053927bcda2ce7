"""Host adapter store: thousands of registered adapters, loaded lazily, a bounded host cache.

Registering validates the adapter in full (so a bad one fails at load time and nothing changes),
keeps its page layout, and caches its packed rows. Only `max_cpu_loras` weight files keep their
rows in host memory; the rest are re-read from disk on demand. The cache and the layouts are keyed
by the weight file's identity (path, inode, size, mtime, ctime), so one directory registered under
many names is read and validated once, whatever the cache holds. `stage` starts such a re-read on
one of STAGE_WORKERS threads as soon as a request for the adapter arrives, so the step loop that
admits it later finds the rows cached instead of reading the disk itself.
Each (re-)registration bumps a version: the pool keys pages by (name, version), so a replaced
adapter's stale pages are never served.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import os
import threading
from pathlib import Path

import jax
import numpy as np

from slora_jax.model.peft import load_peft_adapter
from slora_jax.model.config import ModelConfig
from slora_jax.model.layout import AdapterLayout, pack_adapter


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


# Disk reads in flight at once (`stage`): a read is mostly file I/O and numpy casts, which release
# the GIL, so a few overlap. 8 where the machine has 16 cores or more, half the cores (at least 4)
# below that (see bench/RESULTS.md).
STAGE_WORKERS = min(8, max(4, (os.cpu_count() or 8) // 2))


def host_cache_bytes(gb: float | None) -> int:
    """EngineConfig.max_cpu_lora_gb in bytes; None: 40% of the machine's physical memory."""
    if gb is not None:
        if gb <= 0:
            raise ValueError(f"host_cache_gb must be > 0, got {gb}")
        return int(gb * 2**30)
    try:
        return int(0.4 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # no sysconf: files only
        return 1 << 62


class AdapterStore:
    def __init__(self, cfg: ModelConfig, dtype, page_size: int, max_rank: int, host_cache_size: int = 256,
                 *, pad_to_max_rank: bool = False, host_cache_bytes: int | None = None,
                 stage_workers: int = STAGE_WORKERS, tp: int = 1, whole_rows: bool = False):
        self.cfg, self.dtype, self.page_size, self.max_rank = cfg, dtype, page_size, max_rank
        # Each rank row on whole pool rows: the TPU kernels' layout (lora.whole_rows_layout).
        self.whole_rows = whole_rows
        self.tp = tp  # devices the pool's rows are split over: pack_adapter lays the rows out for them
        # Lay every adapter out at max_rank on every target module (the padded-slots baseline).
        self.pad_rank = max_rank if pad_to_max_rank else None
        self.host_cache_size = host_cache_size
        # A cap on the cached rows' bytes as well (None: files only): 256 all-linear rank-64
        # llama-7b adapters are ~80 GB of pinned host memory. The newest file always stays.
        self.host_cache_bytes = host_cache_bytes
        self._cached_bytes = 0
        self.entries: dict[str, AdapterEntry] = {}
        self._rows: collections.OrderedDict[tuple, object] = collections.OrderedDict()
        self._layouts: dict[tuple, AdapterLayout] = {}  # file id -> layout, of every file validated
        self._version = 0
        self.disk_loads = 0
        # Disk reads started by `stage`, by file: stage_workers threads, made on first use. The lock
        # guards the cache, these futures and disk_loads (the worker writes all three).
        if stage_workers < 1:
            raise ValueError(f"stage_workers must be >= 1, got {stage_workers}")
        self.stage_workers = stage_workers
        self._lock = threading.Lock()
        self._staging: dict[tuple, concurrent.futures.Future] = {}
        self._stager: concurrent.futures.ThreadPoolExecutor | None = None

    def register(self, name: str, path: str | os.PathLike) -> AdapterEntry:
        """Validate and register; re-registering a name always reads its files again. A file
        already read and validated under another name (the same bytes: its file id holds inode,
        size, mtime and ctime) is not read again; its rows come from disk when first used."""
        return self.register_many({name: path}, workers=1)[0]

    def register_many(self, adapters: dict, workers: int | None = None) -> list[AdapterEntry]:
        """`register` for {name: path}, the files read and validated `workers` at a time (threads;
        default: up to 8, one a core): a server starting with a thousand customers' adapter files
        reads them side by side. All or nothing: if any adapter fails, its error (the first in
        `adapters`' order) is raised and no name is registered. Each file is read once, as in
        `register`; names already registered read theirs again."""
        items = [(name, path, _file_id(path)) for name, path in adapters.items()]
        todo: dict[tuple, tuple[str, object]] = {}
        for name, path, fid in items:
            if fid not in todo and (name in self.entries or fid not in self._layouts):
                todo[fid] = (name, path)

        n = max(1, min(workers or min(8, os.cpu_count() or 1), len(todo)))
        if n == 1:  # in this thread, in order: the first failure stops it
            for fid, (name, path) in todo.items():
                self._layouts[fid], rows = self._load(name, path)
                self._cache(fid, rows)
        else:
            self._load_side_by_side(todo, n)
        entries = []
        for name, path, fid in items:
            self._version += 1
            entries.append(AdapterEntry(name, str(path), self._version, self._layouts[fid], fid))
            self.entries[name] = entries[-1]
        return entries

    def _load_side_by_side(self, todo: dict, n: int) -> None:
        """`_load` every {file id: (name, path)} of todo on n threads, at most 2n files in flight;
        each is cached and its layout kept in todo's order (the host cache ends the same as
        loading one by one). Files that validate are kept even when another fails (a retry
        without the bad one reads nothing again); then the first failure in todo's order raises."""
        fids, first_error = list(todo), None
        with concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="slora-adapter-register") as pool:
            futures = {fid: pool.submit(self._load, *todo[fid]) for fid in fids[:2 * n]}
            for i, fid in enumerate(fids):
                if i + 2 * n < len(fids):
                    nxt = fids[i + 2 * n]
                    futures[nxt] = pool.submit(self._load, *todo[nxt])
                try:
                    layout, rows = futures.pop(fid).result()
                except Exception as e:  # noqa: BLE001: raised below, after the others are kept
                    first_error = first_error or e
                    continue
                self._cache(fid, rows)
                self._layouts[fid] = layout
        if first_error is not None:
            raise first_error

    def unregister(self, name: str) -> AdapterEntry:
        return self.entries.pop(name)

    def get(self, name: str) -> AdapterEntry:
        return self.entries[name]

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def rows(self, entry: AdapterEntry):
        """Packed rows [L, rows, W] for the adapter version `entry`: from the cache, from a read
        `stage` started (waiting for it), else from disk now."""
        with self._lock:
            staged = self._staging.pop(entry.file_id, None)
            if entry.file_id in self._rows:
                self._rows.move_to_end(entry.file_id)
                return self._rows[entry.file_id]
        if staged is not None:
            return staged.result()  # its error, if the read failed, is this call's error
        return self._read(entry)

    def stage(self, entry: AdapterEntry) -> bool:
        """Start reading `entry`'s rows from disk on a store worker thread unless they are
        cached or already on their way; True if a read started. Called when a request for a
        non-resident adapter arrives: by its admission the rows are (usually) in host memory."""
        with self._lock:
            # Finished reads are dropped: their rows are cached (or were evicted, and `rows`
            # reads again), and a failed one fails again where `rows` reads.
            for k in [k for k, f in self._staging.items() if f.done()]:
                del self._staging[k]
            fid = entry.file_id
            if fid in self._rows or fid in self._staging:
                return False
            if self._stager is None:
                self._stager = concurrent.futures.ThreadPoolExecutor(
                    self.stage_workers, thread_name_prefix="slora-adapter-stage")
            self._staging[fid] = self._stager.submit(self._read, entry)
            return True

    def in_host_cache(self, entry: AdapterEntry) -> bool:
        """Whether entry's packed rows sit in host memory (a page-in needs no disk read)."""
        with self._lock:
            return entry.file_id in self._rows

    def ready(self, entry: AdapterEntry) -> bool:
        """False while a read `stage` started for entry's file is still running: paging it in now
        would wait for the disk."""
        with self._lock:
            staged = self._staging.get(entry.file_id)
            return entry.file_id in self._rows or staged is None or staged.done()

    def _load(self, name: str, path) -> tuple[AdapterLayout, np.ndarray]:
        """Read and validate one adapter directory: its layout and packed rows."""
        adapter = load_peft_adapter(path, self.cfg, name=name, max_rank=self.max_rank, dtype=None)  # may raise
        layout = AdapterLayout.of(adapter, self.cfg, self.page_size, self.pad_rank, self.whole_rows)
        return layout, pack_adapter(adapter, layout, self.cfg, self.dtype, self.tp)

    def _read(self, entry: AdapterEntry):
        layout, rows = self._load(entry.name, entry.path)
        if layout != entry.layout:
            raise RuntimeError(f"adapter {entry.name!r} changed on disk since it was registered; "
                               "register it again")
        with self._lock:
            self.disk_loads += 1
        return self._cache(entry.file_id, rows)

    def resize_host_cache(self, size: int, nbytes: int | None = None) -> None:
        """Keep at most `size` weight files' rows (and `nbytes` bytes of them, if given) in host
        memory from now on, dropping the least recently used at once (not at the next insert)."""
        with self._lock:
            self.host_cache_size = size
            self.host_cache_bytes = nbytes
            self._evict()

    def set_stage_workers(self, n: int) -> None:
        """Read with `n` threads from the next `stage` on; reads already started finish."""
        if n < 1:
            raise ValueError(f"stage_workers must be >= 1, got {n}")
        with self._lock:
            old = None
            if n != self.stage_workers:
                old, self._stager, self.stage_workers = self._stager, None, n
        if old is not None:
            old.shutdown(wait=False)

    def _evict(self) -> None:
        """Drop least recently used files past the file cap or the byte cap (not the newest)."""
        def over():
            return len(self._rows) > self.host_cache_size or (
                self.host_cache_bytes is not None and self._cached_bytes > self.host_cache_bytes and len(self._rows) > 1)
        while self._rows and over():
            _, rows = self._rows.popitem(last=False)
            self._cached_bytes -= rows.nbytes

    def _cache(self, key, rows: np.ndarray):
        staged = _pinned_host(rows)
        with self._lock:
            old = self._rows.pop(key, None)
            self._cached_bytes += staged.nbytes - (old.nbytes if old is not None else 0)
            self._rows[key] = staged  # a re-read file is the most recent, like a new one
            self._evict()
        return staged
