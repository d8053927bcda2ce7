"""The prefix cache's index: which pool page holds the K/V of which full page of tokens.

A full page of a sequence is keyed by a hash chained over the sequence: the key of the page
before it, the adapter version the sequence runs (`AdapterEntry.key`, None for the base model)
and the page's token ids. K/V depends on the adapter through every layer below, so the same
tokens under two adapters, or under two versions of one adapter, never share a page. Only full
pages are indexed; a sequence's last, partial page stays its own.

The index stores each page's parent key, adapter key and tokens, and `match` compares them, so a
hash collision costs a miss, never a wrong page. Which pages are in use, idle or free is the
pool's business (pool.py); this module maps keys to pages, and gives the scheduler a request's
cached prefix (`cached_prefix`) and takes its new full pages (`offer_pages`). Host only: no JAX.
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Sequence

ROOT = 0  # the parent key of a sequence's first page


@dataclasses.dataclass(frozen=True)
class PageKey:
    key: int                 # the chained hash
    parent: int              # the previous page's key (ROOT for the first page)
    adapter: Hashable        # the adapter version (None: the base model)
    tokens: tuple[int, ...]  # the page's token ids


def page_key(parent: int, adapter: Hashable, tokens: Sequence[int]) -> PageKey:
    tokens = tuple(tokens)
    return PageKey(hash((parent, adapter, tokens)), parent, adapter, tokens)


def extend_keys(keys: list[PageKey], tokens: Sequence[int], adapter: Hashable, page_size: int,
                limit: int, unknown: int | None = None) -> list[PageKey]:
    """Append to `keys` (the keys of a sequence's first pages, computed before) the keys of its
    next full pages, up to `limit` pages in all; stops at a page holding `unknown` (a token the
    host does not know yet). Returns `keys`."""
    while len(keys) < limit:
        i = len(keys)
        page = tokens[i * page_size:(i + 1) * page_size]
        if len(page) < page_size or (unknown is not None and unknown in page):
            break
        keys.append(page_key(keys[-1].key if keys else ROOT, adapter, page))
    return keys


def request_keys(req, adapter: Hashable, page_size: int, unknown: int) -> list[PageKey]:
    """The chained keys of a request's full pages of known tokens under adapter version
    `adapter`, kept on the request (`page_keys`) and extended as it grows."""
    if req.page_keys_for != adapter:
        req.page_keys, req.page_keys_for = [], adapter
    return extend_keys(req.page_keys, req.tokens, adapter, page_size, len(req.tokens) // page_size, unknown)


def cached_prefix(pool, req, adapter: Hashable, page_size: int, unknown: int) -> list[int]:
    """The cached pages a request admitted now would start with: its longest cached run of full
    pages, short of the page of its last token (computed, to sample the next one: so no
    sequence ever writes a shared page)."""
    keys = request_keys(req, adapter, page_size, unknown)
    return pool.match_prefix(keys[:(len(req.tokens) - 1) // page_size])


def offer_pages(pool, req, adapter: Hashable, page_size: int, unknown: int) -> None:
    """Offer a request's full pages whose K/V is dispatched (`num_computed`) to the cache, from
    the first not offered yet (`pages_cached`); a page holding a token the host does not know yet
    waits for a later call."""
    full = req.num_computed // page_size
    if full <= req.pages_cached:
        return
    keys = request_keys(req, adapter, page_size, unknown)
    n = min(full, len(keys))
    for i in range(req.pages_cached, n):
        pool.cache_page(req.rid, i, keys[i])
    req.pages_cached = max(req.pages_cached, n)


class PrefixIndex:
    """Chained page keys -> pool pages, and back."""

    def __init__(self):
        self.pages: dict[int, int] = {}          # key -> page
        self.keys: dict[int, PageKey] = {}       # page -> its key
        self.by_adapter: dict[Hashable, set[int]] = {}  # adapter version -> its cached pages

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, page: int) -> bool:
        return page in self.keys

    def match(self, keys: Sequence[PageKey]) -> list[int]:
        """The pages holding the longest cached run of `keys` from the first."""
        out = []
        for k in keys:
            page = self.pages.get(k.key)
            if page is None or self.keys[page] != k:
                break
            out.append(page)
        return out

    def insert(self, page: int, k: PageKey) -> bool:
        """Index `page` under `k`; False (and nothing changes) if another page holds that key or
        the page is indexed already."""
        if k.key in self.pages or page in self.keys:
            return False
        self.pages[k.key] = page
        self.keys[page] = k
        self.by_adapter.setdefault(k.adapter, set()).add(page)
        return True

    def remove(self, page: int) -> None:
        k = self.keys.pop(page)
        del self.pages[k.key]
        group = self.by_adapter[k.adapter]
        group.discard(page)
        if not group:
            del self.by_adapter[k.adapter]

    def adapter_pages(self, adapter: Hashable) -> list[int]:
        return sorted(self.by_adapter.get(adapter, ()))

    def check(self) -> None:
        assert len(self.pages) == len(self.keys)
        for page, k in self.keys.items():
            assert self.pages[k.key] == page, f"page {page} indexed under another key"
            assert page in self.by_adapter[k.adapter]
        assert sum(map(len, self.by_adapter.values())) == len(self.keys)
