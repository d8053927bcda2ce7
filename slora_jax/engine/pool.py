"""The host side of the unified page pool: one free list for KV cache and adapter weights.

A page is a slot index valid in every layer's pool array (S-LoRA's design). Each page is, at any
time, exactly one of: free, KV of one request, weights of one adapter version, or cached KV
(shared by the requests holding it, or idle). Adapters are refcounted by the running requests
that use them; an idle adapter stays resident as a cache and is evicted only when pages are short.

Page 0 is the null page: never handed out, it absorbs the writes and reads of padded rows.

Prefix caching (prefix_cache.py) adds a third kind of page: a full KV page indexed by its
content. It is shared read-only by every sequence whose prefix matches (refcounted in
`page_refs`); when the last one lets go it stays as an idle cached page. Idle adapters and idle
cached pages are evicted least recently used first, whichever kind that is; nothing a running
request holds is ever evicted.

`RegionPool` is the same allocator with the pages split in two fixed regions, for the benchmark's
memory baselines: adapters only in one (evicting idle adapters inside it, or waiting), KV only in
the other (never evicting adapters: the scheduler preempts). With `slot_pages` every adapter takes
exactly that many pages, so the region is `region_pages // slot_pages` fixed-size slots.
"""

from __future__ import annotations

import collections
import itertools
from typing import Hashable

from slora_jax.engine.prefix_cache import PageKey, PrefixIndex

NULL_PAGE = 0


class OutOfPages(Exception):
    """Not enough free (or evictable) pages; the caller preempts, waits or refuses."""


class UnifiedPool:
    def __init__(self, total_pages: int):
        if total_pages < 2:
            raise ValueError(f"the pool needs at least 2 pages (page 0 is reserved), got {total_pages}")
        self.total_pages = total_pages - 1  # usable pages; page 0 is the null page
        self._free: list[int] = list(range(total_pages - 1, 0, -1))
        self._afree = self._free  # adapters take from (and give back to) the same free list
        self.kv: dict[Hashable, list[int]] = {}
        self.adapters: dict[Hashable, list[int]] = {}
        self.refs: dict[Hashable, int] = {}
        self._idle: collections.OrderedDict[Hashable, int] = collections.OrderedDict()  # eviction order
        self._doomed: set[Hashable] = set()  # retired (replaced/unloaded) versions, forever: never
        # handed out again; their pages go as soon as they are idle
        self.pins: dict[Hashable, int] = {}  # prefetch pins: references no request holds yet
        self.evictions = 0
        # prefix caching: the index of cached pages, the sequences holding each shared page, and
        # the idle cached pages in eviction order. Both idle queues carry the tick at which each
        # entry went idle, so eviction takes whichever head is older.
        self.prefix = PrefixIndex()
        self.page_refs: dict[int, int] = {}
        self._idle_pages: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._ticks = itertools.count()
        self.cached_evictions = 0

    # -- accounting --------------------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def kv_pages(self) -> int:
        """Pages holding KV of running requests (a shared page counts once)."""
        return sum(map(len, self.kv.values())) - sum(self.page_refs.values()) + len(self.page_refs)

    @property
    def cached_pages(self) -> int:
        """Idle pages holding cached KV: no request holds them; evictable."""
        return len(self._idle_pages)

    @property
    def adapter_pages(self) -> int:
        """Pages holding adapter weights (RegionPool: the pages reserved for them)."""
        return sum(map(len, self.adapters.values()))

    @property
    def resident_pages(self) -> int:
        """Pages holding adapter weights."""
        return sum(map(len, self.adapters.values()))

    def evictable_pages(self) -> int:
        """Idle adapter pages and idle cached KV pages."""
        return sum(len(self.adapters[k]) for k in self._idle) + len(self._idle_pages)

    def available(self) -> int:
        """Pages KV could have right now, evicting idle adapters and cached pages if needed."""
        return len(self._free) + self.evictable_pages()

    def adapter_available(self) -> int:
        """Pages an adapter could have right now, evicting idle pages if needed."""
        return len(self._afree) + self.evictable_pages()

    def budget(self, extra_kv: int = 0) -> "Budget":
        """What admissions may take now (plus `extra_kv` pages about to be freed by KV)."""
        return Budget(self.available() + extra_kv)

    def kv_capacity(self, adapter_pages: int) -> int:
        """KV pages one request could ever have next to an adapter of `adapter_pages` pages."""
        return self.total_pages - adapter_pages

    def _take(self, n: int) -> list[int]:
        if n > len(self._free):
            self._evict_until(n)
        pages = self._free[-n:] if n else []
        del self._free[len(self._free) - n:]
        return pages

    def _take_adapter(self, n: int) -> list[int]:
        return self._take(n)

    def _evict_until(self, n: int) -> None:
        """Evict idle adapters and idle cached pages, least recently used first, until the free
        list (the adapters' and KV's, one list in a UnifiedPool) holds n pages; all or nothing."""
        if n > self.adapter_available():
            raise OutOfPages(f"need {n} pages, {len(self._afree)} free and {self.evictable_pages()} evictable")
        while len(self._afree) < n:
            if self._idle_pages and (not self._idle or next(iter(self._idle_pages.values())) <
                                     next(iter(self._idle.values()))):
                self._evict_cached_page()
            else:
                self._evict_adapter()

    def _evict_adapter(self) -> None:
        key, _ = self._idle.popitem(last=False)
        self._release_pages(key)
        self.evictions += 1

    def _evict_cached_page(self) -> None:
        page, _ = self._idle_pages.popitem(last=False)
        self.prefix.remove(page)
        self._free.append(page)
        self.cached_evictions += 1

    def _release_pages(self, key) -> None:
        self._afree.extend(reversed(self.adapters.pop(key)))
        self.refs.pop(key, None)
        self.pins.pop(key, None)
        self._idle.pop(key, None)

    # -- KV cache ----------------------------------------------------------------------------

    def grow_kv(self, rid: Hashable, n: int) -> list[int]:
        """Append n pages to request rid's KV page table; all or nothing."""
        pages = self._take(n)
        self.kv.setdefault(rid, []).extend(pages)
        return pages

    def free_kv(self, rid: Hashable) -> None:
        """Give back request rid's pages: private ones to the free list; a shared page loses a
        reference, and with its last it stays cached, idle (the tail pages of a sequence first
        in the LRU order), or is freed if the cache retired it."""
        for p in reversed(self.kv.pop(rid, [])):
            n = self.page_refs.get(p)
            if n is None:
                self._free.append(p)
            elif n > 1:
                self.page_refs[p] = n - 1
            else:
                del self.page_refs[p]
                if p in self.prefix:
                    self._idle_pages[p] = next(self._ticks)
                else:
                    self._free.append(p)

    # -- prefix cache ------------------------------------------------------------------------

    def match_prefix(self, keys) -> list[int]:
        """The cached pages of the longest run of `keys` (PageKeys, from the first page)."""
        return self.prefix.match(keys)

    def share_kv(self, rid: Hashable, pages: list[int]) -> None:
        """Start request rid's page table (it holds none yet) with cached pages (`match_prefix`),
        read-only: each gains a reference and leaves the idle queue."""
        if self.kv.get(rid):
            raise ValueError(f"request {rid!r} already holds pages")
        for p in pages:
            n = self.page_refs.get(p, 0)
            if n == 0:
                del self._idle_pages[p]  # KeyError: not a cached page
            self.page_refs[p] = n + 1
        self.kv[rid] = list(pages)

    def cache_page(self, rid: Hashable, index: int, key: PageKey) -> bool:
        """Index page `index` of request rid (full, its K/V written) under `key`, shared from now
        on. False if it is shared already or another page holds that key (it stays private)."""
        page = self.kv[rid][index]
        if page in self.page_refs or not self.prefix.insert(page, key):
            return False
        self.page_refs[page] = 1
        return True

    def retire_prefix(self, adapter: Hashable) -> None:
        """Take an adapter version's pages out of the cache: idle ones are freed now, pages in use
        once their last request lets go. No later request hits them."""
        for p in self.prefix.adapter_pages(adapter):
            self.prefix.remove(p)
            if self._idle_pages.pop(p, None) is not None:
                self._free.append(p)

    # -- adapters ----------------------------------------------------------------------------

    def is_resident(self, key: Hashable) -> bool:
        return key in self.adapters

    def is_idle(self, key: Hashable) -> bool:
        return key in self._idle

    def is_doomed(self, key: Hashable) -> bool:
        return key in self._doomed

    def acquire_adapter(self, key: Hashable, n_pages: int) -> tuple[list[int], bool]:
        """Take a reference to adapter `key`, allocating its pages if not resident.
        Returns (pages, newly_allocated); the caller must fill new pages before they are read."""
        if key in self._doomed:
            raise KeyError(f"adapter {key!r} has been replaced or unloaded")
        if key in self.adapters:
            if self.pins.get(key):  # a prefetch pin's reference passes to this caller
                self._unpin(key)
            else:
                self.refs[key] += 1
            self._idle.pop(key, None)
            return self.adapters[key], False
        pages = self._take_adapter(n_pages)
        self.adapters[key] = pages
        self.refs[key] = 1
        return pages, True

    def release_adapter(self, key: Hashable) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            if key in self._doomed:
                self._release_pages(key)
            else:
                self._idle[key] = next(self._ticks)  # most recently used at the end

    def pin_adapter(self, key: Hashable, n_pages: int) -> tuple[list[int], bool]:
        """Prefetch: take a reference on adapter `key` that no request holds yet (allocating its
        pages if not resident). The adapter cannot be evicted while pinned; the pin passes to the
        next `acquire_adapter` of the key, or `unpin_adapter` drops it."""
        pages, new = self.acquire_adapter(key, n_pages)
        self.pins[key] = self.pins.get(key, 0) + 1
        return pages, new

    def unpin_adapter(self, key: Hashable) -> None:
        """Drop an unused prefetch pin: the adapter becomes idle (or is freed if stale)."""
        if self.pins.get(key):
            self._unpin(key)
            self.release_adapter(key)

    def _unpin(self, key: Hashable) -> None:
        self.pins[key] -= 1
        if not self.pins[key]:
            del self.pins[key]

    def drop_adapter(self, key: Hashable) -> None:
        """Retire a replaced/unloaded adapter version: it is never acquired again, and its pages
        are freed now if idle, else once its last user finishes. Its cached KV pages go too."""
        self._doomed.add(key)
        self.retire_prefix(key)
        if key in self.adapters and self.refs.get(key, 0) == 0:
            self._release_pages(key)

    def discard_adapter(self, key: Hashable) -> None:
        """Free an idle adapter's pages now without retiring the key (its load failed, so the
        pages were never filled); a later acquire allocates and loads it afresh."""
        if key in self.adapters:
            assert self.refs.get(key, 0) == 0, f"adapter {key} is still referenced"
            self._release_pages(key)

    def evict_idle(self) -> int:
        """Free every idle adapter and cached page (for tests and shutdown). Returns pages freed."""
        n = len(self._idle_pages)
        while self._idle_pages:
            self._evict_cached_page()
        for key in list(self._idle):
            n += len(self.adapters[key])
            self._release_pages(key)
            self.evictions += 1
        return n

    # -- invariants --------------------------------------------------------------------------

    def check(self) -> None:
        owners: dict[int, object] = {}
        holders = collections.Counter()
        for kind, table in (("kv", self.kv), ("adapter", self.adapters)):
            for key, pages in table.items():
                for p in pages:
                    if kind == "kv" and p in self.page_refs:
                        holders[p] += 1
                        continue
                    assert p not in owners, f"page {p} owned by {owners[p]} and {kind}:{key}"
                    owners[p] = f"{kind}:{key}"
        for p, n in self.page_refs.items():
            assert n > 0 and holders[p] == n, f"shared page {p} has {n} references and {holders[p]} holders"
            assert p not in owners, f"shared page {p} also owned by {owners[p]}"
            owners[p] = "shared"
        for p in self._idle_pages:
            assert p not in owners, f"idle cached page {p} also owned by {owners[p]}"
            assert p in self.prefix, f"idle cached page {p} is not in the index"
            owners[p] = "cached"
        for p in self.prefix.keys:
            assert owners.get(p) in ("shared", "cached"), f"indexed page {p} is {owners.get(p, 'unowned')}"
        self.prefix.check()
        for p in self._free + (self._afree if self._afree is not self._free else []):
            assert p not in owners, f"free page {p} also owned by {owners[p]}"
            owners[p] = "free"
        assert NULL_PAGE not in owners, "the null page was handed out"
        assert len(owners) == self.total_pages, f"{self.total_pages - len(owners)} pages leaked"
        for key in self._idle:
            assert self.refs[key] == 0, f"idle adapter {key} has refs"
        for key, n in self.refs.items():
            assert n >= 0 and key in self.adapters
        for key, n in self.pins.items():
            assert 0 < n <= self.refs.get(key, 0), f"adapter {key} has {n} pins and {self.refs.get(key)} refs"


class Budget:
    """Pages that admissions may still take in one scheduling pass: one count for KV and adapters."""
    __slots__ = ("pages",)

    def __init__(self, pages: int):
        self.pages = pages

    def fits(self, kv: int, adapter: int) -> bool:
        return kv + adapter <= self.pages

    def take(self, kv: int, adapter: int) -> None:
        self.pages -= kv + adapter


class SplitBudget:
    """RegionPool's: KV and adapter pages counted apart."""
    __slots__ = ("kv", "adapter")

    def __init__(self, kv: int, adapter: int):
        self.kv, self.adapter = kv, adapter

    def fits(self, kv: int, adapter: int) -> bool:
        return kv <= self.kv and adapter <= self.adapter

    def take(self, kv: int, adapter: int) -> None:
        self.kv -= kv
        self.adapter -= adapter


class RegionPool(UnifiedPool):
    """Pages 1..region_pages hold adapter weights only, the rest KV only (see the module doc).

    `adapter_pages` is the region's size, reserved whether or not adapters fill it (so free +
    kv + adapter pages = total, as in the unified pool); `resident_pages` is what they fill."""

    def __init__(self, total_pages: int, region_pages: int, slot_pages: int | None = None):
        super().__init__(total_pages)
        if not 1 <= region_pages <= self.total_pages - 1:
            raise ValueError(f"the adapter region must hold 1 to {self.total_pages - 1} of the pool's "
                             f"{self.total_pages} usable pages (at least one is left for KV), got {region_pages}")
        if slot_pages is not None and not 1 <= slot_pages <= region_pages:
            raise ValueError(f"slot_pages must be in [1, {region_pages}], got {slot_pages}")
        self.region_pages = region_pages
        self.slot_pages = slot_pages
        self.max_adapters = region_pages // slot_pages if slot_pages else None
        self._free = list(range(total_pages - 1, region_pages, -1))   # KV
        self._afree = list(range(region_pages, 0, -1))                 # adapters

    @property
    def adapter_pages(self) -> int:
        return self.region_pages

    def evictable_pages(self) -> int:
        """Idle adapter pages (in the adapter region)."""
        return sum(len(self.adapters[k]) for k in self._idle)

    def available(self) -> int:
        """KV pages free now, or held by idle cached pages: KV never evicts adapters."""
        return len(self._free) + len(self._idle_pages)

    def budget(self, extra_kv: int = 0) -> SplitBudget:
        return SplitBudget(self.available() + extra_kv, self.adapter_available())

    def kv_capacity(self, adapter_pages: int) -> int:
        return self.total_pages - self.region_pages if adapter_pages <= self.region_pages else -1

    def _take(self, n: int) -> list[int]:
        if n > self.available():
            raise OutOfPages(f"need {n} KV pages, {len(self._free)} free and {len(self._idle_pages)} cached "
                             "(adapters are not evicted for KV)")
        while len(self._free) < n:
            self._evict_cached_page()
        return super()._take(n)

    def _take_adapter(self, n: int) -> list[int]:
        if self.slot_pages is not None and n != self.slot_pages:
            raise ValueError(f"every adapter takes one slot of {self.slot_pages} pages, asked for {n}")
        if n > self.adapter_available():
            raise OutOfPages(f"need {n} adapter pages, {len(self._afree)} free and {self.evictable_pages()} evictable")
        while len(self._afree) < n:
            self._evict_adapter()
        pages = self._afree[-n:] if n else []
        del self._afree[len(self._afree) - n:]
        return pages

    def check(self) -> None:
        super().check()
        region = self.region_pages
        assert all(1 <= p <= region for p in self._afree), "a free adapter page outside the region"
        assert all(p > region for p in self._free), "a free KV page inside the adapter region"
        for key, pages in self.adapters.items():
            assert all(1 <= p <= region for p in pages), f"adapter {key} outside the region"
            if self.slot_pages is not None:
                assert len(pages) == self.slot_pages, f"adapter {key} is not one slot"
        for rid, pages in self.kv.items():
            assert all(p > region for p in pages), f"KV of {rid} inside the adapter region"
        assert all(p > region for p in self._idle_pages), "a cached page inside the adapter region"
        if self.max_adapters is not None:
            assert len(self.adapters) <= self.max_adapters
