"""Step inputs: the host arrays one jitted step runs on, built from the scheduler's plan.

`StepInputBuilder` turns a plan's chunks into `StepInputs` (tokens, positions, the K/V slot of
each new token, page tables, sampling arrays) in fixed-shape buckets, so few step shapes compile.
`AdapterSlots` is the LoRA side: which adapter sits in which slot of a step, and the pool rows
of each slot's A and B (`LoraInputs`). Both are numpy only; the step puts them on the device.
"""

from __future__ import annotations

import itertools

import numpy as np

from slora_jax.engine import step as paged
from slora_jax.engine.prompt_logprobs import prompt_inputs
from slora_jax.engine.adapter_store import AdapterEntry, AdapterStore
from slora_jax.engine import attention
from slora_jax.engine.pool import NULL_PAGE, UnifiedPool
from slora_jax.lora import LoraInputs, rows_needed
from slora_jax.engine.scheduler import MAX_PREFILL_SEQS, PENDING, Request
from slora_jax.model.config import TARGET_MODULES, ModelConfig
from slora_jax.model.layout import page_rows
from slora_jax.sampling import FED, SamplingExtras

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def pow2(n: int, lo: int = 1) -> int:
    """The bucket of n: the next power of two, at least lo."""
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def group_by_adapter(chunks: list) -> None:
    """Order a step's sequences so each adapter's tokens are contiguous and base-model tokens
    come last: the segment form the LoRA kernels read each adapter once for (stable otherwise)."""
    first: dict = {}
    for req, _, _ in chunks:
        if req.adapter is not None:
            first.setdefault(req.adapter.key, len(first))
    chunks.sort(key=lambda c: first[c[0].adapter.key] if c[0].adapter is not None else len(first))


class AdapterSlots:
    """The engine's side of a LoRA step: its distinct adapters in slots, each slot's pool rows.

    `backends` decides per step how many slots a step gets and which LoRA backend runs it, and
    builds the kernels' tables (its `_slot_bucket`, `_step_backend` and `_make_lora_inputs`)."""

    def __init__(self, cfg: ModelConfig, store: AdapterStore, pool: UnifiedPool, page_size: int,
                 max_lora_rank: int, backends):
        self.cfg, self.store, self.pool, self.ps, self.max_lora_rank = cfg, store, pool, page_size, max_lora_rank
        self.backends = backends
        self._rows: dict = {}       # adapter key -> its residency (see residency)
        self._modules_key, self._union = None, set()  # the registered adapters' modules (cached)

    def residency(self, entry: AdapterEntry) -> tuple:
        """(page list, row indices of its pages, {module set: slot record}) of a resident adapter,
        computed once per residency, not every step: a reload gets a new page list, so the entry
        is checked by identity."""
        pages = self.pool.adapters[entry.key]
        hit = self._rows.get(entry.key)
        if hit is None or hit[0] is not pages:
            if len(self._rows) > 4 * max(len(self.pool.adapters), 64):  # drop the evicted ones
                self._rows = {k: v for k, v in self._rows.items() if k in self.pool.adapters}
            hit = self._rows[entry.key] = (pages, page_rows(pages, entry.layout.rows, self.ps), {})
        return hit

    def slot_record(self, entry: AdapterEntry, modules: tuple[str, ...]) -> np.ndarray:
        """One LoRA slot's inputs for a step carrying `modules`, flat: per module its A rows and
        B rows (padded with the null page's row 0 to max_lora_rank's row counts) and its rank
        (0 where the adapter does not target it). Cached per residency: a step stacks these."""
        _, all_rows, records = self.residency(entry)
        rec = records.get(modules)
        if rec is None:
            parts = []
            for module in modules:
                a, b, rk = self.empty_arrays(module, 1)
                m = entry.layout.modules.get(module)
                if m is not None:
                    a[0, :m.a_rows] = all_rows[m.a_row:m.a_row + m.a_rows]
                    b[0, :m.b_rows] = all_rows[m.b_row:m.b_row + m.b_rows]
                    rk[0] = m.rank
                parts += [a[0], b[0], rk]
            rec = records[modules] = np.concatenate(parts)
        return rec

    def lora_inputs(self, token_reqs: list[Request | None], t: int, *, decode: bool) -> LoraInputs | None:
        """The LoraInputs of a step whose token i belongs to token_reqs[i] (None: padding), or
        None when no token has an adapter."""
        entries = list({r.adapter.key: r.adapter for r in token_reqs if r is not None and r.adapter}.values())
        if not entries:
            return None
        sa = self.backends._slot_bucket(len(entries), t, decode)
        backend = self.backends._step_backend(sa, decode)
        assert len(entries) <= sa, (len(entries), sa)
        slot = {e.key: i for i, e in enumerate(entries)}
        token_slot = np.array([slot[r.adapter.key] if r is not None and r.adapter is not None else -1
                               for r in token_reqs], np.int32)
        # Tokens are grouped by slot (see group_by_adapter): slot s owns [seg[s], seg[s+1]).
        live = token_slot[token_slot >= 0]
        if np.any(np.diff(live) < 0) or (len(live) and token_slot[:len(live)].min() < 0):
            raise AssertionError("LoRA tokens are not grouped by adapter; call group_by_adapter")
        counts = np.bincount(live, minlength=sa)
        seg_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        modules = self.step_modules(entries)
        stacked = np.stack([self.slot_record(e, modules) for e in entries])
        table = np.zeros((sa, stacked.shape[1]), np.int32)  # empty slots: null page, rank 0
        table[:len(entries)] = stacked
        rows, ranks, at = {}, {}, 0
        for module in modules:
            ra, rb = self.row_counts(module)
            rows[module] = (np.ascontiguousarray(table[:, at:at + ra]),
                            np.ascontiguousarray(table[:, at + ra:at + ra + rb]))
            ranks[module] = np.ascontiguousarray(table[:, at + ra + rb])
            at += ra + rb + 1
        return self.backends._make_lora_inputs(t, token_slot, seg_starts, rows, ranks, backend, decode)

    def null_inputs(self, t: int, modules: tuple[str, ...], sa: int, decode: bool) -> LoraInputs:
        """LoraInputs of a step of t tokens carrying `modules` in sa slots, none of them live."""
        arrays = {m: self.empty_arrays(m, sa) for m in modules}
        return self.backends._make_lora_inputs(
            t, np.full(t, -1, np.int32), np.zeros(sa + 1, np.int32), {m: (a, b) for m, (a, b, _) in arrays.items()},
            {m: rk for m, (_, _, rk) in arrays.items()}, self.backends._step_backend(sa, decode), decode)

    def empty_arrays(self, module: str, sa: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A module's (A rows [sa, RA], B rows [sa, RB], ranks [sa]) with every slot empty (the
        null page, rank 0), at max_lora_rank: what a step fills in for its adapters."""
        ra, rb = self.row_counts(module)
        return np.zeros((sa, ra), np.int32), np.zeros((sa, rb), np.int32), np.zeros(sa, np.int32)

    def row_counts(self, module: str) -> tuple[int, int]:
        """Pool rows of a module's A^T and of its B at max_lora_rank (a slot's row-index widths)."""
        rank, width = self.max_lora_rank, self.cfg.kv_size
        fin, fout = self.cfg.module_shape(module)
        whole = self.store.whole_rows
        return rows_needed(rank, fin, width, whole), rows_needed(rank, fout, width, whole)

    def module_sets(self) -> list[tuple[str, ...]]:
        """The module sets a LoRA step can carry: the registered adapters' modules within the
        attention projections, then all of them (one set when they are the same)."""
        key = (self.store._version, len(self.store.entries))
        if self._modules_key != key:
            union = {m for e in self.store.entries.values() for m in e.layout.modules}
            self._modules_key, self._union = key, union
        sets = []
        for group in (ATTENTION_MODULES, TARGET_MODULES):
            chosen = tuple(m for m in group if m in self._union)
            if chosen and chosen not in sets:
                sets.append(chosen)
        return sets

    def step_modules(self, entries: list[AdapterEntry]) -> tuple[str, ...]:
        """The modules a LoRA step carries: the smallest set of `module_sets` that holds every
        module of its adapters, not the exact set, so batches of adapters with different targets
        share step shapes (a module that no adapter of the batch targets has rank 0 in every
        slot: no work in the kernels, masked work in the one-hot path)."""
        have = {m for e in entries for m in e.layout.modules}
        for chosen in self.module_sets():
            if have <= set(chosen):
                return chosen
        return tuple(m for m in TARGET_MODULES if m in have | self._union)  # a replaced version's


def xla_key_window(t: int, longest: int) -> int:
    """The key window of the xla attention's packed prefill step of t tokens whose longest chunk
    has `longest` (0: none, every query block reads every new token)."""
    qb = min(t, attention.QUERY_BLOCK)
    window = max(qb, pow2(longest))
    return window if window + qb < t else 0


class StepInputBuilder:
    """Builds each step's `StepInputs` from its plan.

    Prefill steps pack every chunk's tokens into one row of pow2(tokens, 16) and keep one
    sequence bucket (MAX_PREFILL_SEQS); decode steps have one token a sequence, pow2(sequences)
    rows. A prefill step whose chunks have context in the pool (a prompt after cached pages, a
    split prompt's later chunk) lists its context pages, padded to `context_bucket` of their
    count: at least `context_pages`, which the scheduler keeps a step's context within unless one
    sequence alone has more, so such steps have one shape per token bucket and key window.
    Under the Pallas prefill kernel (`prefill_kernel`), which reads only each row's own context
    pages, a step's listed context costs nothing beyond its rows': `context_pages` then covers
    every row at max_model_len (the engine sets no cap), there is no key window, and every
    prefill step lists its context, none for fresh prompts, so each token bucket has one shape.
    With async scheduling (`feed_from`), a token the host has not seen yet (PENDING) is read
    on the device from the previous step's results."""

    def __init__(self, cfg: ModelConfig, pool: UnifiedPool, page_size: int, attention_backend: str,
                 decode_page_floor: int, slots: AdapterSlots, feed: bool, context_pages: int):
        self.cfg, self.pool, self.ps, self.attention_backend = cfg, pool, page_size, attention_backend
        self.decode_page_floor, self.slots, self.feed = decode_page_floor, slots, feed
        self.context_pages = context_pages
        self.prefill_kernel = attention_backend == "pallas"
        self.prev_results = None    # the previous step's results, on the device (async scheduling)
        self._feed_rows: dict[int, int] = {}  # id(request) -> its row there

    def feed_from(self, results, pending: list) -> None:
        """The step just dispatched: its results (on the device) and plan.pending's rows."""
        self.prev_results = results
        self._feed_rows = {id(req): row for row, req, _ in pending}

    def build(self, plan) -> tuple[paged.StepInputs, set[int]]:
        """(the plan's step inputs, the sequence rows that sample a token)."""
        group_by_adapter(plan.chunks)
        if plan.kind == "prefill":
            inp, samplers = self.prefill(plan.chunks)
        else:
            inp, samplers = self.decode(plan.requests)
        return (self._fed(inp, plan) if self.feed else inp), samplers

    def prefill(self, chunks):
        total = sum(end - start for _, start, end in chunks)
        t = pow2(total, 16)
        s = pow2(max(len(chunks), MAX_PREFILL_SEQS))  # one bucket: rows are cheap
        context = self.prefill_kernel or any(start > 0 for _, start, _ in chunks)
        longest = max(end - start for _, start, end in chunks)
        tokens, positions, kv_slot = np.zeros(t, np.int32), np.zeros(t, np.int32), np.zeros(t, np.int32)
        token_seq = np.full(t, -1, np.int32)  # padding belongs to no sequence
        sample_idx = np.zeros(s, np.int32)
        token_reqs: list[Request | None] = [None] * t
        samplers = set()
        at = 0
        for i, (req, start, end) in enumerate(chunks):
            n = end - start
            pos = np.arange(start, end, dtype=np.int32)
            tokens[at:at + n] = req.tokens[start:end]
            positions[at:at + n] = pos
            kv_slot[at:at + n] = self.kv_slots(req, pos)
            token_seq[at:at + n] = i
            token_reqs[at:at + n] = [req] * n
            sample_idx[i] = at + n - 1
            if end == len(req.tokens):
                samplers.add(i)
            at += n
        reqs = [c[0] for c in chunks]
        inp = paged.StepInputs(tokens=tokens, positions=positions, kv_slot=kv_slot, token_seq=token_seq,
                               page_table=np.full((s, 1), NULL_PAGE, np.int32), ctx_lens=np.zeros(s, np.int32),
                               sample_idx=sample_idx, lora=self.slots.lora_inputs(token_reqs, t, decode=False),
                               decode=False, attention_backend=self.attention_backend, prefill_context=context,
                               key_window=self.key_window(t, longest), **self.sampling_arrays(reqs, s),
                               sampling=sampling_extras(reqs, s), prompt_logprobs=prompt_inputs(chunks, pow2),
                               **(self.context_arrays(chunks) if context else {}))
        return inp, samplers

    def context_bucket(self, pages: int) -> int:
        """The context-page bucket of a prefill step whose chunks have `pages` pages of context."""
        return max(self.context_pages, pow2(pages))

    def context_arrays(self, chunks) -> dict:
        """ctx_pages, ctx_page_seq, ctx_page_fill (StepInputs) of the chunks that start after
        context in the pool: each one's pages up to its start, in row order, padded with the null
        page."""
        ps = self.ps
        per_seq = [(i, self.pool.kv[req.rid][:-(-start // ps)], start)
                   for i, (req, start, _) in enumerate(chunks) if start > 0]
        n = sum(len(pages) for _, pages, _ in per_seq)
        k = self.context_bucket(n)
        pages, seq, fill = np.full(k, NULL_PAGE, np.int32), np.full(k, -1, np.int32), np.zeros(k, np.int32)
        at = 0
        for i, own, start in per_seq:
            m = len(own)
            pages[at:at + m], seq[at:at + m] = own, i
            fill[at:at + m] = ps
            fill[at + m - 1] = start - (m - 1) * ps
            at += m
        return dict(ctx_pages=pages, ctx_page_seq=seq, ctx_page_fill=fill)

    def decode(self, batch: list[Request]):
        s, n = pow2(len(batch)), len(batch)
        tokens, positions, kv_slot = np.zeros(s, np.int32), np.zeros(s, np.int32), np.zeros(s, np.int32)
        ctx_lens = np.zeros(s, np.int32)
        ps, kv = self.ps, self.pool.kv
        pos = [req.num_computed for req in batch]
        tokens[:n] = [req.tokens[p] for req, p in zip(batch, pos)]
        positions[:n] = ctx_lens[:n] = pos
        kv_slot[:n] = [kv[req.rid][p // ps] * ps + p % ps for req, p in zip(batch, pos)]
        inp = paged.StepInputs(tokens=tokens, positions=positions, kv_slot=kv_slot,
                               token_seq=np.arange(s, dtype=np.int32),
                               page_table=self.page_table(batch, s, self.decode_page_floor),
                               ctx_lens=ctx_lens, sample_idx=np.arange(s, dtype=np.int32),
                               lora=self.slots.lora_inputs(batch + [None] * (s - n), s, decode=True),
                               decode=True, attention_backend=self.attention_backend,
                               **self.sampling_arrays(batch, s), sampling=sampling_extras(batch, s))
        return inp, set(range(n))

    def null(self, t: int, s: int, p: int, decode: bool, lora=None, key_window: int = 0) -> paged.StepInputs:
        """Step inputs whose every read and write goes to the null page (prefill: fresh prompts);
        lora = (modules, slots): LoRA inputs of that shape with no live slot."""
        zeros = np.zeros(t, np.int32)
        if lora is not None:
            lora = self.slots.null_inputs(t, *lora, decode)
        fed = dict(token_src=np.full(t, -1, np.int32), prev_results=self.prev_results) if self.feed else {}
        return paged.StepInputs(tokens=zeros, positions=zeros, kv_slot=zeros, **fed,
                                token_seq=np.arange(s, dtype=np.int32) if decode else zeros,
                                page_table=np.full((s, p), NULL_PAGE, np.int32), ctx_lens=np.zeros(s, np.int32),
                                sample_idx=np.arange(s, dtype=np.int32) if decode else np.full(s, t - 1, np.int32),
                                lora=lora, decode=decode, attention_backend=self.attention_backend,
                                prefill_context=decode, key_window=key_window, **self.sampling_arrays([], s))

    def null_context(self, t: int, s: int, k: int, lora=None, key_window: int = 0) -> paged.StepInputs:
        """`null`'s prefill of t tokens, with k context pages that are all padding: the shape of a
        prefill step with context in that bucket (warm-up)."""
        inp = self.null(t, s, 1, decode=False, lora=lora, key_window=key_window)
        return inp.replace(prefill_context=True, ctx_pages=np.full(k, NULL_PAGE, np.int32),
                           ctx_page_seq=np.full(k, -1, np.int32), ctx_page_fill=np.zeros(k, np.int32))

    def _fed(self, inp: paged.StepInputs, plan) -> paged.StepInputs:
        """The tokens still on the device (PENDING on the host) are read from the in-flight step's
        results: token_src gives each one's results row."""
        src = np.full(inp.tokens.shape, -1, np.int32)
        for t in np.flatnonzero(inp.tokens == PENDING):
            src[t] = self._feed_rows[id(plan.chunks[int(inp.token_seq[t])][0])]
        tokens = np.where(src >= 0, 0, inp.tokens).astype(np.int32)
        return inp.replace(tokens=tokens, token_src=src, prev_results=self.prev_results)

    def key_window(self, t: int, longest: int) -> int:
        """The key window of a packed prefill step: xla_key_window, none for the kernel."""
        return 0 if self.prefill_kernel else xla_key_window(t, longest)

    def page_table(self, reqs: list[Request], s: int, floor: int = 1) -> np.ndarray:
        lists = [self.pool.kv[r.rid] for r in reqs]
        lens = np.array([len(pages) for pages in lists], np.int64)
        p = pow2(max(floor, int(lens.max(initial=0))))
        table = np.full((s, p), NULL_PAGE, np.int32)
        if len(lists):  # one scatter of every page, not one row copy per sequence
            flat = np.fromiter(itertools.chain.from_iterable(lists), np.int32, int(lens.sum()))
            rows = np.repeat(np.arange(len(lists)), lens)
            cols = np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)
            table[rows, cols] = flat
        return table

    @staticmethod
    def sampling_arrays(reqs: list[Request], s: int) -> dict:
        def col(f, dtype, pad):
            a = np.full(s, pad, dtype)
            a[:len(reqs)] = [f(r) for r in reqs]
            return a
        return dict(temperature=col(lambda r: r.params.temperature, np.float32, 0.0),
                    top_k=col(lambda r: max(r.params.top_k, 0), np.int32, 0),
                    top_p=col(lambda r: r.params.top_p, np.float32, 1.0),
                    seeds=col(lambda r: r.seed % 2**32, np.uint32, 0),
                    steps=col(lambda r: r.generated, np.int32, 0))

    def kv_slots(self, req: Request, positions: np.ndarray) -> np.ndarray:
        pages = np.asarray(self.pool.kv[req.rid], np.int32)
        return pages[positions // self.ps] * self.ps + positions % self.ps


# ---------------------------------------------------------------------------------------------
# sampling extras


def sampling_extras(reqs: list[Request], s: int) -> SamplingExtras | None:
    """The SamplingExtras of a step over `reqs` (padded to s rows): None when no request uses any,
    and each part only when some request uses it (top logprobs at pow2 of the largest k, >= 4)."""
    users = [r for r in reqs if r.params.uses_extras]
    if not users:
        return None
    k = max(r.params.num_top_logprobs for r in users)
    parts = {}
    biases = [row_bias(r) for r in reqs]
    if any(biases):
        parts.update(bias_arrays(biases, s))
    if any(r.params.min_p > 0 for r in users):
        parts["min_p"] = _column([r.params.min_p for r in reqs], s, np.float32, 0.0)
    if any(r.params.penalized for r in users):
        parts.update(penalty_arrays(reqs, s))
    return SamplingExtras(**parts, top_logprobs=pow2(k, 4) if k else 0)


def row_bias(req: Request) -> dict[int, float]:
    """A request's logit_bias, and -inf on its stop ids while it is short of min_tokens."""
    p = req.params
    bias = dict(p.logit_bias or {})
    if req.generated < p.min_tokens:
        for t in req.stops:
            bias[t] = -np.inf
    return bias


def bias_arrays(biases: list[dict[int, float]], s: int) -> dict:
    k = pow2(max(len(b) for b in biases), 8)
    ids, values = np.full((s, k), -1, np.int32), np.zeros((s, k), np.float32)
    for i, b in enumerate(biases):
        ids[i, :len(b)] = list(b)
        values[i, :len(b)] = list(b.values())
    return dict(bias_ids=ids, bias_values=values)


def penalty_arrays(reqs: list[Request], s: int) -> dict:
    """Penalties [s, 3] (presence, frequency, repetition; padding rows and unpenalized requests
    neutral), and the penalized requests' tokens in history [s, H] (H: pow2 of the longest)."""
    penalized = [(i, r) for i, r in enumerate(reqs) if r.params.penalized]
    h = pow2(max(len(r.tokens) for _, r in penalized), 16)
    penalties = np.tile(np.array([0.0, 0.0, 1.0], np.float32), (s, 1))
    history = np.full((s, h), -1, np.int32)
    for i, r in penalized:
        penalties[i] = (r.params.presence_penalty, r.params.frequency_penalty, r.params.repetition_penalty)
        tokens = np.asarray(r.tokens, np.int32)
        history[i, :len(tokens)] = np.where(tokens == PENDING, FED, tokens)
    return dict(penalties=penalties, history=history,
                prompt_lens=_column([r.prompt_len for r in reqs], s, np.int32, 0))


def _column(values: list, s: int, dtype, pad) -> np.ndarray:
    a = np.full(s, pad, dtype)
    a[:len(values)] = values
    return a
