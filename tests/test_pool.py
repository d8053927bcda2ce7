"""The host allocator of the unified page pool (slora_jax/engine/pool.py): pure host, no JAX.

A hypothesis state machine drives one UnifiedPool through random interleavings of what the engine
does to it (admit, grow, finish, preempt, adapter acquire/release, evict, re-register) against a
plain-Python model that predicts every outcome, LRU evictions included. After every step: pool.check()
passes, the accounting adds up, every page the model knows is still where it was, held adapters are
never evicted, and stale (dropped) versions are never handed out again.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from slora_jax.engine.pool import NULL_PAGE, OutOfPages, RegionPool, UnifiedPool

NAMES = ("a", "b", "c", "d")
HAS_PINS = hasattr(UnifiedPool, "pin_adapter")  # prefetch pins: references no request holds yet
HAS_DISCARD = hasattr(UnifiedPool, "discard_adapter")  # undo of an allocation whose load failed


def snapshot(pool: UnifiedPool):
    """Everything observable about the pool's state (used to prove a failed call changed nothing)."""
    return (pool.free_pages, sorted(pool._free), sorted(pool._afree), {k: list(v) for k, v in pool.kv.items()},
            {k: list(v) for k, v in pool.adapters.items()}, dict(pool.refs), list(pool._idle),
            set(pool._doomed), dict(getattr(pool, "pins", {})), pool.evictions)


class PoolMachine(RuleBasedStateMachine):
    """Model: KV pages per request, resident adapters with their pages, refs, LRU idle order."""

    @initialize(total=st.integers(min_value=2, max_value=24), split=st.integers(0, 23))
    def setup(self, total, split):
        self.pool = self.new_pool(total, split)
        self.usable = self.pool.total_pages
        self.kv: dict[int, list[int]] = {}                # rid -> its pages, in order
        self.req_adapter: dict[int, tuple | None] = {}    # running rid -> the adapter key it holds
        self.waiting: list[tuple[int, tuple | None]] = []  # preempted: (rid, adapter name or None)
        self.holds: list[tuple] = []                      # free-standing adapter references
        self.resident: dict[tuple, list[int]] = {}        # key -> its pages
        self.refs: dict[tuple, int] = {}
        self.pins: dict[tuple, int] = {}                  # prefetch pins (each also counts in refs)
        self.idle: list[tuple] = []                       # LRU order: least recently released first
        self.version = {n: 1 for n in NAMES}
        self.size: dict[tuple, int] = {}                  # pages of each adapter version
        self.dropped: set[tuple] = set()
        self.evictions = 0
        self.next_rid = 0

    def new_pool(self, total: int, split: int) -> UnifiedPool:
        return UnifiedPool(total)

    def pages_for(self, pages: int) -> int:
        """The pages an adapter drawn with `pages` pages takes."""
        return pages

    # -- model helpers -------------------------------------------------------------------------

    def free(self) -> int:
        return self.usable - sum(map(len, self.kv.values())) - sum(map(len, self.resident.values()))

    def adapter_free(self) -> int:
        return self.free()

    def evictable(self) -> int:
        return sum(len(self.resident[k]) for k in self.idle)

    def expect_take(self, n: int, kind: str) -> bool:
        """Predict taking n pages for `kind` ("kv" or "adapter"): False if it must fail; else
        apply the LRU evictions it must do."""
        if n > self.adapter_free() + self.evictable():
            return False
        while self.adapter_free() < n:
            key = self.idle.pop(0)
            del self.resident[key]
            del self.refs[key]
            self.evictions += 1
        return True

    def expect_acquire_resident(self, key: tuple) -> None:
        if self.pins.get(key):  # the pin's reference passes to the caller
            self.pins[key] -= 1
            if not self.pins[key]:
                del self.pins[key]
        else:
            self.refs[key] += 1
        if key in self.idle:
            self.idle.remove(key)

    def key_of(self, name: str, pages: int) -> tuple:
        key = (name, self.version[name])
        self.size.setdefault(key, self.pages_for(pages))
        return key

    def acquire(self, key: tuple) -> bool:
        """Acquire `key` on both pool and model; False (and nothing changed) when out of pages."""
        before = snapshot(self.pool)
        n = self.size[key]
        if key in self.resident:
            pages, new = self.pool.acquire_adapter(key, n)
            assert not new and pages == self.resident[key]
            self.expect_acquire_resident(key)
            return True
        if not self.expect_take(n, "adapter"):
            with pytest.raises(OutOfPages):
                self.pool.acquire_adapter(key, n)
            assert snapshot(self.pool) == before, "a failed acquire_adapter changed the pool"
            return False
        pages, new = self.pool.acquire_adapter(key, n)
        assert new and len(pages) == n and NULL_PAGE not in pages
        self.resident[key] = list(pages)
        self.refs[key] = 1
        return True

    def release(self, key: tuple, *, pool: bool = True) -> None:
        if pool:
            self.pool.release_adapter(key)
        self.refs[key] -= 1
        if self.refs[key] == 0:
            if key in self.dropped:  # a stale version goes as soon as its last user does
                del self.resident[key]
                del self.refs[key]
            else:
                self.idle.append(key)

    def grow(self, rid: int, n: int) -> bool:
        before = snapshot(self.pool)
        if not self.expect_take(n, "kv"):
            with pytest.raises(OutOfPages):
                self.pool.grow_kv(rid, n)
            assert snapshot(self.pool) == before, "a failed grow_kv changed the pool"
            return False
        pages = self.pool.grow_kv(rid, n)
        assert len(pages) == n and NULL_PAGE not in pages
        self.kv.setdefault(rid, []).extend(pages)
        return True

    def stop(self, rid: int) -> tuple | None:
        """finish / preempt: free the KV, release the adapter."""
        self.pool.free_kv(rid)
        del self.kv[rid]
        key = self.req_adapter.pop(rid)
        if key is not None:
            self.release(key)
        return key

    def start(self, rid: int, name: str | None, kv_pages: int, adapter_pages: int) -> None:
        """The engine's admission: adapter first, then KV; on a KV miss, give the adapter back."""
        key = None
        if name is not None:
            key = self.key_of(name, adapter_pages)
            if not self.acquire(key):
                return
        if not self.grow(rid, kv_pages):
            if key is not None:
                self.release(key)
            return
        self.req_adapter[rid] = key

    # -- rules ---------------------------------------------------------------------------------

    @rule(name=st.sampled_from((None,) + NAMES), kv_pages=st.integers(1, 6), adapter_pages=st.integers(1, 6))
    def admit(self, name, kv_pages, adapter_pages):
        rid = self.next_rid
        self.next_rid += 1
        self.start(rid, name, kv_pages, adapter_pages)

    @precondition(lambda self: self.req_adapter)
    @rule(data=st.data(), n=st.integers(0, 4))
    def grow_running(self, data, n):
        rid = data.draw(st.sampled_from(sorted(self.req_adapter)))
        self.grow(rid, n)

    @precondition(lambda self: self.req_adapter)
    @rule(data=st.data())
    def finish(self, data):
        self.stop(data.draw(st.sampled_from(sorted(self.req_adapter))))

    @precondition(lambda self: self.req_adapter)
    @rule(data=st.data())
    def preempt(self, data):
        rid = data.draw(st.sampled_from(sorted(self.req_adapter)))
        key = self.stop(rid)
        self.waiting.append((rid, key[0] if key else None))

    @precondition(lambda self: self.waiting)
    @rule(kv_pages=st.integers(1, 6), adapter_pages=st.integers(1, 6))
    def readmit(self, kv_pages, adapter_pages):
        rid, name = self.waiting.pop(0)  # recomputed on the adapter's current version
        self.start(rid, name, kv_pages, adapter_pages)

    @rule(name=st.sampled_from(NAMES), pages=st.integers(1, 6))
    def acquire_adapter(self, name, pages):
        key = self.key_of(name, pages)
        if self.acquire(key):
            self.holds.append(key)

    @precondition(lambda self: self.holds)
    @rule(data=st.data())
    def release_adapter(self, data):
        key = self.holds.pop(data.draw(st.integers(0, len(self.holds) - 1)))
        self.release(key)

    @rule()
    def evict_idle(self):
        expect = sum(len(self.resident[k]) for k in self.idle)
        assert self.pool.evict_idle() == expect
        for key in self.idle:
            del self.resident[key]
            del self.refs[key]
            self.evictions += 1
        self.idle.clear()

    @rule(name=st.sampled_from(NAMES), pages=st.integers(1, 6))
    def reregister(self, name, pages):
        old = (name, self.version[name])
        self.pool.drop_adapter(old)
        self.dropped.add(old)
        if old in self.resident:
            if self.refs[old] == 0:
                del self.resident[old]
                del self.refs[old]
                self.idle.remove(old)
        self.version[name] += 1
        self.size[(name, self.version[name])] = self.pages_for(pages)

    @precondition(lambda self: any(k in self.resident for k in self.dropped))
    @rule(data=st.data())
    def acquire_stale(self, data):
        key = data.draw(st.sampled_from(sorted(k for k in self.dropped if k in self.resident)))
        before = snapshot(self.pool)
        with pytest.raises(KeyError):
            self.pool.acquire_adapter(key, self.size[key])
        if HAS_PINS:
            with pytest.raises(KeyError):
                self.pool.pin_adapter(key, self.size[key])
        assert snapshot(self.pool) == before, "a refused stale acquire changed the pool"

    @precondition(lambda self: HAS_PINS)
    @rule(name=st.sampled_from(NAMES), pages=st.integers(1, 6))
    def pin(self, name, pages):
        """Prefetch: a reference that the next acquire of the key takes over."""
        key = self.key_of(name, pages)
        before = snapshot(self.pool)
        n = self.size[key]
        if key in self.resident:
            self.pool.pin_adapter(key, n)
            self.expect_acquire_resident(key)
        elif self.expect_take(n, "adapter"):
            pages, new = self.pool.pin_adapter(key, n)
            assert new and len(pages) == n
            self.resident[key] = list(pages)
            self.refs[key] = 1
        else:
            with pytest.raises(OutOfPages):
                self.pool.pin_adapter(key, n)
            assert snapshot(self.pool) == before, "a failed pin_adapter changed the pool"
            return
        self.pins[key] = self.pins.get(key, 0) + 1

    def expect_unpin(self, key: tuple) -> None:
        self.pool.unpin_adapter(key)  # drops the pin's reference: idle, or freed if stale
        self.pins[key] -= 1
        if not self.pins[key]:
            del self.pins[key]
        self.release(key, pool=False)

    @precondition(lambda self: HAS_DISCARD and self.idle)
    @rule(data=st.data())
    def discard(self, data):
        """An idle adapter whose pages were never filled: freed, the key stays usable."""
        key = data.draw(st.sampled_from(self.idle))
        self.pool.discard_adapter(key)
        self.idle.remove(key)
        del self.resident[key]
        del self.refs[key]

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        self.expect_unpin(data.draw(st.sampled_from(sorted(self.pins))))

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def consistent(self):
        pool = self.pool
        pool.check()
        assert NULL_PAGE not in pool._free
        assert pool.free_pages + pool.kv_pages + pool.adapter_pages == pool.total_pages == self.usable
        assert pool.free_pages == self.free()
        assert pool.kv == self.kv
        # Resident adapters are exactly the model's, on the same pages: in particular, an adapter
        # with refs > 0 was never evicted or moved.
        assert pool.adapters == self.resident
        assert {k: v for k, v in pool.refs.items()} == self.refs
        assert list(pool._idle) == self.idle
        assert pool.evictions == self.evictions
        assert dict(getattr(pool, "pins", {})) == self.pins
        for key, n in self.refs.items():
            if n > 0:
                assert pool.is_resident(key)
        # A stale version is resident only while someone still uses it.
        for key in self.dropped:
            if key in pool.adapters:
                assert pool.refs[key] > 0

    def teardown(self):
        pool = self.pool
        for rid in list(self.req_adapter):
            self.stop(rid)
        while self.holds:
            self.release(self.holds.pop())
        while self.pins:
            self.expect_unpin(next(iter(self.pins)))
        assert pool.kv_pages == 0
        assert pool.free_pages == pool.total_pages - pool.adapter_pages
        assert all(n == 0 for n in pool.refs.values())
        assert not any(k in pool.adapters for k in self.dropped), "a stale version outlived its users"
        pool.evict_idle()
        pool.check()
        assert pool.free_pages + (pool.adapter_pages if isinstance(pool, RegionPool) else 0) == pool.total_pages
        assert pool.kv_pages == 0 and pool.resident_pages == 0
        assert not pool.adapters and not pool.refs and not pool.kv


PoolMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=60, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestPoolMachine = PoolMachine.TestCase


class RegionPoolMachine(PoolMachine):
    """The same rules on a RegionPool (the "separate" baseline): adapters only in pages
    1..region, evicting idle ones there; KV only in the rest, never evicting. pool.check() also
    proves that no page crossed the split."""

    def new_pool(self, total: int, split: int) -> UnifiedPool:
        total = max(total, 3)
        return RegionPool(total, 1 + split % (total - 2))

    def free(self) -> int:  # KV pages free (pool.free_pages)
        return self.usable - self.pool.region_pages - sum(map(len, self.kv.values()))

    def adapter_free(self) -> int:
        return self.pool.region_pages - sum(map(len, self.resident.values()))

    def expect_take(self, n: int, kind: str) -> bool:
        if kind == "kv":
            return n <= self.free()
        return super().expect_take(n, kind)

    @invariant()
    def split_accounting(self):
        pool = self.pool
        assert pool.adapter_pages == pool.region_pages
        assert pool.resident_pages + pool.adapter_available() - pool.evictable_pages() == pool.region_pages
        assert pool.kv_pages + pool.free_pages == pool.total_pages - pool.region_pages


class SlotPoolMachine(RegionPoolMachine):
    """RegionPool with fixed-size slots (the "padded_slots" baseline): every adapter takes one
    slot, so at most region // slot_pages are resident."""

    def new_pool(self, total: int, split: int) -> UnifiedPool:
        slot, slots = 1 + split % 3, 1 + (split // 3) % 3
        return RegionPool(max(total, slot * slots + 2), slot * slots, slot_pages=slot)

    def pages_for(self, pages: int) -> int:
        return self.pool.slot_pages


for _machine in (RegionPoolMachine, SlotPoolMachine):
    _machine.TestCase.settings = PoolMachine.TestCase.settings
TestRegionPoolMachine = RegionPoolMachine.TestCase
TestSlotPoolMachine = SlotPoolMachine.TestCase


def test_region_pool_keeps_kv_and_adapters_apart():
    pool = RegionPool(1 + 10, 4)
    assert pool.adapter_pages == 4 and pool.free_pages == 6 and pool.available() == 6
    pages, _ = pool.acquire_adapter("A", 3)
    assert max(pages) <= 4
    pool.release_adapter("A")  # idle: KV still cannot have its pages
    with pytest.raises(OutOfPages):
        pool.grow_kv("r", 7)
    assert pool.is_resident("A") and pool.evictions == 0
    assert min(pool.grow_kv("r", 6)) > 4
    with pytest.raises(OutOfPages):
        pool.acquire_adapter("B", 5)  # bigger than the region
    pool.acquire_adapter("B", 4)  # evicts idle A inside the region
    assert not pool.is_resident("A") and pool.evictions == 1
    with pytest.raises(OutOfPages):
        pool.acquire_adapter("C", 1)  # B is held: waits
    assert pool.kv_capacity(4) == 6 and pool.kv_capacity(5) == -1
    pool.check()
    slots = RegionPool(1 + 10, 6, slot_pages=3)
    with pytest.raises(ValueError, match="one slot of 3 pages"):
        slots.acquire_adapter("A", 2)
    with pytest.raises(ValueError, match="adapter region"):
        RegionPool(1 + 10, 10)


# ------------------------------------------------------------------------------------------------
# plain unit tests


def test_null_page_never_handed_out():
    pool = UnifiedPool(9)
    assert pool.total_pages == 8 and pool.free_pages == 8
    got = pool.grow_kv("r", 5) + pool.acquire_adapter("x", 3)[0]
    assert sorted(got) == list(range(1, 9))
    assert NULL_PAGE not in got
    with pytest.raises(OutOfPages):
        pool.grow_kv("r", 1)
    pool.check()


def test_failed_calls_change_nothing():
    pool = UnifiedPool(11)
    pool.grow_kv("r", 4)
    pool.acquire_adapter("x", 3)
    pool.release_adapter("x")  # idle: 3 evictable pages, 3 free
    before = snapshot(pool)
    with pytest.raises(OutOfPages):
        pool.grow_kv("s", 7)
    with pytest.raises(OutOfPages):
        pool.acquire_adapter("y", 7)
    assert snapshot(pool) == before
    assert "s" not in pool.kv and "y" not in pool.adapters


def test_lru_evicts_least_recently_released_first():
    pool = UnifiedPool(1 + 6)
    for key in ("A", "B", "C"):
        pool.acquire_adapter(key, 2)
    for key in ("B", "A", "C"):  # release order: B is the least recently used
        pool.release_adapter(key)
    assert pool.free_pages == 0 and pool.evictable_pages() == 6
    pool.grow_kv("r", 1)
    assert set(pool.adapters) == {"A", "C"} and pool.evictions == 1
    pool.grow_kv("r", 2)  # one free page left over from B; two more means A goes too
    assert set(pool.adapters) == {"C"} and pool.evictions == 2
    # Re-acquiring a resident idle adapter takes it off the LRU list; it is not evictable then.
    pages, new = pool.acquire_adapter("C", 2)
    assert not new and pool.evictable_pages() == 0
    with pytest.raises(OutOfPages):
        pool.grow_kv("r", 2)
    pool.check()


def test_lru_reacquire_refreshes_recency():
    pool = UnifiedPool(1 + 4)
    pool.acquire_adapter("A", 2)
    pool.acquire_adapter("B", 2)
    pool.release_adapter("A")
    pool.release_adapter("B")
    pool.acquire_adapter("A", 2)  # A used again: B is now the least recently used
    pool.release_adapter("A")
    pool.grow_kv("r", 2)
    assert set(pool.adapters) == {"A"}


def test_held_adapter_survives_pressure():
    pool = UnifiedPool(1 + 5)
    pool.acquire_adapter("A", 3)
    with pytest.raises(OutOfPages):
        pool.grow_kv("r", 3)
    assert pool.adapters["A"] and pool.refs["A"] == 1
    pool.check()


def test_drop_in_use_frees_after_last_release():
    pool = UnifiedPool(1 + 8)
    pool.acquire_adapter(("n", 1), 3)
    pool.acquire_adapter(("n", 1), 3)
    pool.drop_adapter(("n", 1))
    with pytest.raises(KeyError):
        pool.acquire_adapter(("n", 1), 3)
    pool.release_adapter(("n", 1))
    assert pool.is_resident(("n", 1)) and pool.free_pages == 5
    pool.release_adapter(("n", 1))
    assert not pool.is_resident(("n", 1)) and pool.free_pages == 8 and pool.evictable_pages() == 0
    pool.check()


def test_dropped_key_is_never_acquired_again():
    pool = UnifiedPool(1 + 8)
    pool.acquire_adapter(("n", 1), 3)
    pool.release_adapter(("n", 1))
    pool.drop_adapter(("n", 1))  # idle: freed at once
    assert pool.free_pages == 8
    with pytest.raises(KeyError):
        pool.acquire_adapter(("n", 1), 3)
