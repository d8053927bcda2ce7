"""S-LoRA's adapter prefetch, the part of the scheduler that runs while a step runs.

`AdapterPrefetch` is a base of `Scheduler` (scheduler.py) and works on its state: the waiting
and running requests, the pool, the admission walk (`_admissions`, run dry to predict the next
admissions), the config and the metrics. Its own state is the pins it holds (`_prefetched`:
adapter key -> the entry and the schedule that pinned it) and the keys a prefetch wrote that no
request has used yet (`_prefetch_loaded`). Host only: no JAX.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class _Prefetched:
    entry: object
    step: int


class AdapterPrefetch:
    def __init__(self):
        self._prefetched: dict[object, _Prefetched] = {}   # key -> pin taken by prefetch
        self._prefetch_loaded: set = set()                 # keys a prefetch wrote, not used yet

    def prefetch(self, plan=None) -> list[tuple[object, list[int]]]:
        """Pin the adapters of the predicted next admissions; returns the cold ones' (entry,
        pages), which the caller fills while the current step (`plan`) runs. The prediction is
        the admission walk, dry, as if the requests that `plan` surely finishes (max_tokens
        reached) had left. Pins of adapters no longer predicted are dropped."""
        if not self.config.prefetch_adapters:
            return []
        leaving = [r for r, _, end in (plan.chunks if plan else ()) if end == len(r.tokens)
                   and r.generated + 1 >= r.params.max_tokens]
        predicted = self._admissions(self.config.max_num_batched_tokens, 0, dry=True, leaving=leaving) \
            if self.waiting else []
        entries = list({e.key: e for _, e, _ in predicted if e is not None}.values())
        want = {e.key for e in entries}
        for key in [k for k in self._prefetched if k not in want]:
            self._unpin(key)
        for e in entries:  # first protect the resident ones from the loads below
            if e.key in self._prefetched:
                self._prefetched[e.key].step = self.steps
            elif self.pool.is_idle(e.key):
                self.pool.pin_adapter(e.key, e.layout.pages)
                self._prefetched[e.key] = _Prefetched(e, self.steps)
        headroom = len(self.running)  # the running batch's next decode step may take a page each
        loads = []
        for e in entries:
            if len(loads) >= self.config.prefetch_adapters:
                break
            if self.pool.is_resident(e.key) or self.pool.is_doomed(e.key):
                continue
            if not self.pool.budget().fits(headroom, e.layout.pages):
                break
            pages, _ = self.pool.pin_adapter(e.key, e.layout.pages)
            self._prefetched[e.key] = _Prefetched(e, self.steps)
            self._prefetch_loaded.add(e.key)
            loads.append((e, pages))
            self.metrics.prefetch_issued.inc()
        return loads

    def _expire_pins(self) -> None:
        """Drop stale pins (the adapter was re-registered or unloaded) and pins that two
        schedules after their prefetch have not used."""
        for key, p in list(self._prefetched.items()):
            current = self.resolve(p.entry.name)
            if current is None or current.key != key or self.steps > p.step + 1:
                self._unpin(key)

    def _unpin(self, key) -> None:
        self._prefetched.pop(key)
        self.pool.unpin_adapter(key)
        if key in self._prefetch_loaded:
            self.metrics.prefetch_dropped.inc()
            if not self.pool.is_resident(key):
                self._prefetch_loaded.discard(key)

    def drop_pins(self) -> bool:
        """Give back every prefetch pin (pages are short). True if there were any."""
        keys = list(self._prefetched)
        for key in keys:
            self._unpin(key)
        return bool(keys)
