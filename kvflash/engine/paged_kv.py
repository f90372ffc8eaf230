"""PagedKV: one sequence's KV over the shared chunk pool and host tier, under a residency policy.

It implements the model's KVCache interface. Each forward: `begin` picks the resident set for the
step, pages chunks in and out and plans the step (`StepPlan`); `attend` writes the step's K/V into
its slots and attends over the resident chunks in logical order; `end` scores the chunks if the step
recorded queries and seals chunks that became full (summary, ready to page out). With a budget that
holds the whole context it computes what the dense cache computes (invariant 4).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvflash import KVFlashError, kernels
from kvflash.config import ResidencyConfig
from kvflash.engine.chunk_index import shared_run
from kvflash.engine.decode_staging import DecodeStaging
from kvflash.engine.host_tier import HostTier
from kvflash.engine.pager import Fetch, Pager
from kvflash.engine.pool import ChunkPool, summary_shape
from kvflash.engine.positions import CachePositions
from kvflash.engine.residency import Selector, pin_chunks
from kvflash.engine.scoring import ChunkScorer
from kvflash.engine.sequence import UNKNOWN, Chunk, Sequence
from kvflash.engine.step_plan import Listing, StepPlan
from kvflash.engine.to_device import on_device
from kvflash.kvcache import sdpa
from kvflash.storage import ROOT_HASH, chain_hashes


class PagedKV:
    """One sequence's chunk table and its steps. Beside it: moving chunks between the tiers
    (`Pager`), when to select (`Selector`), scoring (`ChunkScorer`), key rotations
    (`CachePositions`), a step's plan (`StepPlan`) and the decode buffers (`DecodeStaging`). It stays
    one class, over 250 lines, because its steps (`begin`, `attend`, `end`) and the calls that take
    chunks in or give them up (`adopt`, `share`, `truncate`, `park`, `free`) all write one chunk
    table and one chain of names, in an order each step depends on."""

    def __init__(
        self,
        pool: ChunkPool,
        host: HostTier,
        cfg: ResidencyConfig,
        budget_chunks: int,
        fingerprint: str | None = None,
        step_chunks: int | None = None,
    ):
        """`step_chunks`: the most chunks one of its steps adds (the engine's prefill step), where
        known: its prefill steps then score the chunks only where the next one could evict."""
        if cfg.chunk_tokens != pool.chunk_tokens:
            raise KVFlashError(f"chunk_tokens {cfg.chunk_tokens} differs from the pool's {pool.chunk_tokens}")
        if budget_chunks < cfg.floor_chunks() and cfg.policy != "full":
            raise KVFlashError(
                f"a budget of {budget_chunks} chunks is below the floor of {cfg.floor_chunks()} "
                f"(sinks {cfg.sink_chunks} + tail {cfg.tail_chunks} + 2)"
            )
        self.pool, self.host, self.cfg, self.budget = pool, host, cfg, budget_chunks
        self.device = pool.kv.device
        """The pool's device: every tensor of a step is made there."""
        self.seq = Sequence(cfg.chunk_tokens)
        self.pager = Pager(pool, host)
        self.moved, self.chunk_nbytes = self.pager.moved, self.pager.chunk_nbytes
        self.chain: tuple[str, list[str]] = ("", [])
        """(fingerprint, chain hashes) of the first chunks, as far as they are known (a restore's,
        then each snapshot's): a snapshot hashes only the chunks after them."""
        self.fingerprint = fingerprint
        """The model fingerprint its sealed chunks of exact KV are named under (the engine's):
        named chunks are shared with every sequence whose prompt begins the same (`share`)."""
        self._unnamed: list[Chunk] = []
        """Chunks sealed by a step whose token is still on the device, named at `settle`."""
        self.exact_chunks: int | None = None
        """None while every step ran with every earlier chunk resident; else the leading whole
        chunks computed before the first step that did not (0 for approximate KV restored): a cut
        back to them (`truncate`) holds exact KV again."""
        self.selector = Selector(cfg, budget_chunks, step_chunks)
        self.step = 0
        self.uses_triton = kernels.uses_triton(
            pool.kv, head_dim=pool.cfg.head_dim, chunk_tokens=cfg.chunk_tokens
        )
        """Triton kernels on CUDA; elsewhere SDPA over the gathered slots (the same maths)."""
        self.staging: DecodeStaging | None = pool.stagings.take(budget_chunks) if self.uses_triton else None
        """The decode steps' device buffers, where the Triton kernels run (given back at `free`)."""
        self.positions = CachePositions(pool.cfg, cfg, self.device)
        self.scorer = ChunkScorer(pool, host, cfg, self.uses_triton, self.moved)
        self.listing: Listing | None = None
        """The last selection's chunks, attended over until the next selection."""
        self.plan: StepPlan | None = None
        """The step begun; None between steps."""

    @property
    def scout(self) -> bool:
        """The step begun is a scout: it computes scores only, and neither advances the sequence nor
        seals chunks. False between steps."""
        return self.plan is not None and self.plan.scout

    @property
    def recording(self) -> bool:
        """This step records each layer's query, to score the chunks at `end` (from exact keys in
        scouts and decode re-selection, from the summaries in other prefill steps)."""
        return self.plan is not None and self.plan.queries is not None and self.plan.n_cand > 0

    def record_queries(self, queries: list[torch.Tensor]) -> None:
        """Each layer's queries of this step, recorded by a batch that attended on this sequence's
        behalf (`BatchKV`, a replayed CUDA graph): `end` scores the chunks from them."""
        assert self.recording, "only a step that records queries takes them"
        self.plan.queries = queries

    @property
    def fetch(self) -> Fetch | None:
        """Reads a lazy restore's chunks into host-tier slots (`adopt`); None once freed or eager."""
        return self.pager.fetch

    @property
    def summary_shape(self) -> torch.Size:
        return torch.Size(summary_shape(self.pool.cfg, self.cfg.summary_blocks))

    def chain_hashes(self, fp: str, n: int) -> list[str]:
        """The chain hashes under fp of the first n sealed chunks, hashing only those past `chain`."""
        c = self.cfg.chunk_tokens
        known = self.chain[1][:n] if self.chain[0] == fp else []
        parent = known[-1] if known else ROOT_HASH
        self.chain = (fp, known + chain_hashes(fp, self.seq.tokens[len(known) * c : n * c], c, parent))
        return list(self.chain[1])

    # -- pins --------------------------------------------------------------------------------------

    def pin_range(self, lo: int, hi: int) -> None:
        """Pins the chunks covering token positions [lo, hi); refused if it would break the floor."""
        pin_chunks(self.seq, self.cfg, self.budget, lo, hi)
        self.selector.dirty = True

    def unpin(self, lo: int, hi: int) -> None:
        self.selector.dirty = True
        c = self.cfg.chunk_tokens
        for i in range(lo // c, min((hi - 1) // c + 1, len(self.seq.chunks))):
            self.seq.chunks[i].pinned = False

    def unpin_all(self) -> None:
        self.selector.dirty = True
        for ch in self.seq.chunks:
            ch.pinned = False

    @property
    def n_pinned(self) -> int:
        return sum(ch.pinned for ch in self.seq.chunks)

    # -- residency ---------------------------------------------------------------------------------

    def resident(self) -> list[Chunk]:
        return [c for c in self.seq.chunks if c.gpu is not None]

    @property
    def approximate(self) -> bool:
        """Some step ran without every earlier chunk resident: this KV is not what the dense cache
        computes, and is stored apart from exact KV (snapshots.APPROX_SUFFIX)."""
        return self.exact_chunks is not None

    def load_to_host(self, chunks: list[Chunk]) -> None:
        """Brings disk-only chunks into the host tier in one parallel read (selection and prefetch)."""
        self.pager.load_to_host(chunks)

    def chunk_kv(self, index: int) -> torch.Tensor:
        """A sealed chunk's KV `[L, 2, Hkv, C, D]` wherever it lives; a disk-only chunk is read first."""
        return self.pager.chunk_kv(self.seq.chunks[index])

    # -- a step ------------------------------------------------------------------------------------

    def begin(self, input_ids: torch.Tensor, positions: torch.Tensor, scout: bool = False) -> None:
        """Starts a step of input_ids at positions [T]; a `scout` step scores the chunks for its
        queries and writes nothing the sequence keeps (`end`)."""
        self._begin(input_ids.tolist(), int(positions[0]), positions.numel(), scout=scout)

    def begin_ids(self, ids: list[int], start: int, scout: bool = False) -> None:
        """`begin` for ids known on the host (a prefill piece): reads nothing back."""
        self._begin(ids, start, len(ids), scout=scout)

    def begin_decode(self, token: int, position: int, send: bool = True) -> None:
        """`begin` for one token known on the host: reads nothing back from the device. Without `send`
        the step's inputs stay in `staging.fields`, for a batch that sends its sequences' together."""
        self._begin([token], position, 1, send)

    def _begin(self, ids: list[int], start: int, t: int, send: bool = True, scout: bool = False) -> None:
        if start != len(self.seq):
            raise KVFlashError(f"positions start at {start} but the sequence holds {len(self.seq)} tokens")
        end = start + t
        c = self.cfg.chunk_tokens
        self.seq.ensure_chunks(end)
        first, last = start // c, (end - 1) // c
        want = self.selector.want(self.seq, first, last, t, scout, self.approximate)
        if want is not None:  # else decode inside the resident append head: nothing moves
            self._select(want, first, last, scout)
        self.plan = self._plan(ids, start, end, scout, send)

    def _select(self, want: set[int], first: int, last: int, scout: bool) -> None:
        """Pages the chunks of `want` in and the others out for a step writing chunks first..last,
        and lists them (`listing`). A page that fails (a full pool) leaves no listing, and the next
        step selects again: the last listing may name slots paged out and since given to another
        sequence."""
        order = sorted(want)
        wanted = [self.seq.chunks[i] for i in order]
        try:
            self.pager.page([ch for ch in self.resident() if ch.index not in want], wanted)
        except BaseException:
            self.listing, self.selector.dirty = None, True
            raise
        if not scout and len(want) <= last and self.exact_chunks is None:  # want lies in 0..last
            self.exact_chunks = first  # and holds first..last: this step's chunks, from `first`
        for ch in wanted:
            ch.last_use = self.step
        self.selector.selected()
        dev, i32, c = self.device, torch.int32, self.cfg.chunk_tokens
        slots = on_device([self.seq.chunks[i].gpu for i in order], i32, dev)
        index = on_device(order, i32, dev)
        rot = self.positions.listed(order, first, [ch.score for ch in wanted])
        key_pos = None
        if self.staging is not None:
            self.staging.list(slots, rot)
        else:
            key_pos = (index[:, None].long() * c + torch.arange(c, device=dev)).flatten()
        self.listing = Listing(slots, index, rot, key_pos, len(order))

    def _plan(self, ids: list[int], start: int, end: int, scout: bool, send: bool) -> StepPlan:
        """Where the step's tokens are written, which keys each query sees and whether the step scores
        the chunks; the listing is the last selection's."""
        c, dev, i32 = self.cfg.chunk_tokens, self.device, torch.int32
        chunks, listing, t = self.seq.chunks, self.listing, end - start
        mask = None
        if self.staging is not None and t == 1:
            slot, off = chunks[start // c].gpu, start % c
            self.staging.stage(ids[0], start, slot, off, listing.n, send)
            w_slot, w_off = self.staging.write
        else:
            pos = torch.arange(start, end, device=dev)
            w_slot = on_device([chunks[p // c].gpu for p in range(start, end)], i32, dev)
            w_off = (pos % c).to(i32)
            if not self.uses_triton:
                mask = listing.key_pos[None, :] <= pos[:, None]
        n_cand = start // c
        capture = self.selector.records(self.seq, t, scout, self.approximate)
        cand_rot = self.positions.candidates(n_cand) if capture else None
        exact, queries = capture and (scout or t == 1), [] if capture else None
        return StepPlan(ids, start, scout, listing, w_slot, w_off, mask, n_cand, cand_rot, exact, queries)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        plan, kv = self.plan, self.pool.kv
        kernels.write_tokens(kv, layer, plan.write_slot, plan.write_offset, k, v)
        self.keep_queries(q)
        if self.uses_triton:
            return self._attend_triton(layer, q, plan)
        listing = plan.listing
        # K/V in the pool's dtype are read in q's (the model's) dtype: a 16-bit KV under an fp32
        # model attends in fp32, as the reference twins do (fp8 KV: its values, in fp32).
        h_kv, d = kv.shape[3], kv.shape[5]
        kv = kernels.reference.kv_values(kv[listing.slots, layer])  # [n, 2, Hkv, C, D]
        keys = kv[:, 0].transpose(0, 1)  # [Hkv, n, C, D]
        if listing.rot is not None:
            keys = kernels.reference.shift_keys(keys, listing.rot)
        keys = keys.reshape(h_kv, -1, d).to(q.dtype)
        values = kv[:, 1].transpose(0, 1).reshape(h_kv, -1, d).to(q.dtype)
        return sdpa(q, keys, values, plan.mask)

    def keep_queries(self, q: torch.Tensor) -> None:
        """Keeps a layer's scoring queries from the step's rows q, on a step that scores at `end`."""
        plan = self.plan
        if plan.queries is not None and plan.n_cand:
            plan.queries.append(q[-self.cfg.score_queries :].float())

    @property
    def joins_batched_prefill(self) -> bool:
        """Whether this step's piece may attend in one launch with other sequences' pieces
        (`MixedKV`): the Triton kernels, more than one token (one goes through the decode
        kernel), and keys at their own positions (no rotation)."""
        plan = self.plan
        return self.uses_triton and len(plan.ids) > 1 and plan.listing.rot is None

    def _attend_triton(self, layer: int, q: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        scale = q.shape[-1] ** -0.5
        if q.shape[0] == 1:
            return self.staging.attend(q, self.pool.kv, layer, scale)
        listing = plan.listing
        return kernels.prefill_attention(
            q, self.pool.kv, layer, listing.slots, listing.order, plan.start, scale, listing.rot
        )

    def end(self) -> None:
        plan, self.plan = self.plan, None
        self.step += 1
        self.selector.ended(plan.end - plan.start, plan.scout, self._score(plan) if plan.queries else None)
        if plan.scout:
            return
        self.seq.tokens.extend(plan.ids)
        c = self.cfg.chunk_tokens
        old_sealed, new_sealed = plan.start // c, plan.end // c
        if new_sealed > old_sealed:
            self._seal(self.seq.chunks[old_sealed:new_sealed])

    def settle(self, token: int) -> None:
        """The id of the token a step fed on the device (`BatchKV.begin_decode`), once read back: a
        chunk that token completed is named now. A sequence whose last id is known already (its
        step did not end) is left as it is."""
        if self.seq.tokens and self.seq.tokens[-1] == UNKNOWN:
            self.seq.tokens[-1] = token
            unnamed, self._unnamed = self._unnamed, []
            if unnamed:
                self._name(unnamed)

    def _score(self, plan: StepPlan) -> torch.Tensor:
        """The candidates' scores for the step's recorded queries: from exact keys (a scout also
        reads the host tier's) or from the summaries."""
        qs, n = torch.stack(plan.queries), plan.n_cand  # [L, t, Hq, D]
        if plan.exact:
            chunks = self.seq.chunks[:n]
            if plan.scout:
                self._read_likely(qs, chunks, plan.cand_rot)
            return self.scorer.exact(qs, chunks, self.seq.summaries, plan.cand_rot, from_host=plan.scout)
        return self.scorer.estimated(qs, self.seq.summaries[:n], plan.cand_rot)

    def _read_likely(self, qs: torch.Tensor, chunks: list[Chunk], rot: torch.Tensor | None) -> None:
        """Reads into the host tier the `scout_reads` disk-only chunks whose summaries score highest,
        so that the scout scores them from their keys (`ResidencyConfig.scout_reads`)."""
        if not self.cfg.scout_reads:
            return
        disk = [ch for ch in chunks if ch.gpu is None and ch.host is None and ch.disk is not None]
        if not disk:
            return
        index = on_device([ch.index for ch in disk], torch.long, self.device)
        estimate = self.scorer.estimated(qs, self.seq.summaries[index], None if rot is None else rot[index])
        best = estimate.topk(min(self.cfg.scout_reads, len(disk))).indices.tolist()
        self.load_to_host([disk[i] for i in best])

    def _seal(self, chunks: list[Chunk]) -> None:
        slots = on_device([ch.gpu for ch in chunks], torch.int32, self.device)
        summaries = kernels.chunk_summaries(self.pool.kv, slots, self.cfg.summary_blocks)
        for ch, summary in zip(chunks, summaries, strict=True):
            self.seq.set_summary(ch.index, summary)
            ch.sealed = True
        if self.seq.tokens[-1] == UNKNOWN:  # a name commits to every id: it waits for `settle`
            self._unnamed = chunks
        else:
            self._name(chunks)

    def _name(self, chunks: list[Chunk]) -> None:
        """Names newly sealed chunks by their chain hash and publishes their slots, where their KV is
        exact (a step that ran with every earlier chunk resident) and their parent is named."""
        first = chunks[0].index
        parent = self.seq.chunks[first - 1].key if first else ROOT_HASH
        if self.fingerprint is None or self.approximate or parent is None:
            return
        c = self.cfg.chunk_tokens
        tokens = self.seq.tokens[first * c : (chunks[-1].index + 1) * c]
        keys = chain_hashes(self.fingerprint, tokens, c, parent)
        for ch, key in zip(chunks, keys, strict=True):
            ch.key = key
            self.pool.index.add(key, ch.gpu)
        fp, known = self.chain
        if len(known) == first and fp in ("", self.fingerprint):  # a snapshot hashes none of them again
            self.chain = (self.fingerprint, known + keys)

    # -- chunks from elsewhere, and the sequence's end ---------------------------------------------

    def adopt(
        self,
        fp: str,
        hashes: list[str],
        tokens: list[list[int]],
        summaries: torch.Tensor,
        *,
        approximate: bool,
        host_slots: list[int] | None = None,
        fetch: Fetch | None = None,
    ) -> None:
        """Takes into this empty sequence whole sealed chunks read from the store (a restore): the
        chunks named by `hashes` (their chain under fp), each chunk's token ids and their summaries
        [n, *summary_shape]. Their KV is either in the host-tier slots `host_slots` (read, one per
        chunk: it counts as moved from disk) or read by `fetch` when selected (lazy: each chunk
        stays disk-only until then). `approximate`: the KV was computed under eviction."""
        assert (host_slots is None) != (fetch is None), "a restore gives host slots or a fetch"
        self.seq.ensure_chunks(len(hashes) * self.cfg.chunk_tokens)
        self.seq.set_summaries(summaries)
        for i, (h, ids) in enumerate(zip(hashes, tokens, strict=True)):
            ch = self.seq.chunks[i]
            self.seq.tokens.extend(ids)
            ch.sealed = True
            if host_slots is None:
                ch.disk = h
            else:
                ch.host = host_slots[i]
        self.pager.touch()
        self.exact_chunks = 0 if approximate else None
        self.chain = (fp, list(hashes))
        if fetch is not None:
            self.pager.fetch = fetch
        else:
            self.moved["disk"] += len(hashes) * self.chunk_nbytes

    def name_restored(self) -> None:
        """Names the chunks a restore of exact KV gave this empty-before sequence by the chain they
        were stored under, publishing their host copies (a lazy one's as they are read)."""
        fp, keys = self.chain
        if fp != self.fingerprint or self.approximate:
            return
        for ch, key in zip(self.seq.chunks, keys, strict=False):
            ch.key = key
            if ch.host is not None:
                self.host.publish(key, ch.host)

    def share(self, ids: list[int], keys: list[str], lenders: Iterable[PagedKV] = ()) -> int:
        """Takes into this empty sequence the longest run of ids' whole chunks, named by `keys`
        (their chain hashes under `fingerprint`), that some sequence holds as exact KV in the pool
        or the host tier, as references to those slots: the pool slot where the chunk is resident,
        else its host copy. The slots are sealed, so no sequence writes them; each reader evicts or
        drops its own reference. Summaries are copied from the first of `lenders` that has them
        (`summaries_of`), else computed again from the keys. Returns the tokens taken."""
        assert not len(self.seq), "share needs an empty sequence"
        c, fp = self.cfg.chunk_tokens, self.fingerprint
        n = shared_run(keys, self.pool.index.find, self.host.find)
        if not n:
            return 0
        self.seq.ensure_chunks(n * c)
        self.seq.tokens.extend(ids[: n * c])
        self.pager.take_shared(self.seq.chunks, keys[:n])
        lent = next((s for kv in lenders if (s := kv.summaries_of(fp, keys[:n])) is not None), None)
        if lent is not None:
            self.seq.set_summaries(lent.clone())
        else:
            self.seq.set_summaries(self.pager.summaries(self.seq.chunks, self.cfg.summary_blocks))
        self.chain = (fp, keys[:n])
        self.selector.dirty = True
        return n * c

    def summaries_of(self, fp: str, keys: list[str]) -> torch.Tensor | None:
        """Its summaries of the chunks named by `keys` (chain hashes under fp: the first len(keys)
        chunks of a prompt) where it holds them as exact KV: the same tokens at the same places,
        so the same keys and summaries. None where it does not."""
        n, (own_fp, chain) = len(keys), self.chain
        held = self.seq.summaries
        if not n or own_fp != fp or len(chain) < n or chain[n - 1] != keys[n - 1] or held is None:
            return None
        if held.shape[0] < n or self.seq.n_sealed < n or (self.approximate and n > self.exact_chunks):
            return None
        return held[:n]

    def truncate(self, n_chunks: int) -> None:
        """Keeps the first n_chunks chunks (sealed) and drops every later token, giving back the
        dropped chunks' slots: a prompt that shares only that prefix with this sequence reuses it.
        A kept chunk's KV depends only on the tokens before it, so it is what a prefill of the prompt
        would compute (under the same residency); the next step selects again. Kept chunks all
        computed before the sequence first evicted (`exact_chunks`) hold exact KV again: its
        snapshots are exact KV and its next chunks are named (shared) again."""
        assert n_chunks <= self.seq.n_sealed, "only whole sealed chunks can be kept"
        with self.pager.lock:  # a prefetch in flight finishes its batch first
            dropped = self.seq.chunks[n_chunks:]
            for ch in dropped:
                ch.disk = None  # a prefetch that listed it no longer reads it
            self.pager.release(dropped)
            del self.seq.chunks[n_chunks:]
            del self.seq.tokens[n_chunks * self.cfg.chunk_tokens :]
            del self.chain[1][n_chunks:]
            if self.exact_chunks is not None and n_chunks <= self.exact_chunks:
                self.exact_chunks = None  # what is left was computed with every chunk before it
        self.selector.reset()

    def park(self) -> None:
        """Leaves the pool for the host tier while idle: whole chunks are paged out (a chunk that
        has a host copy keeps it), the last partial chunk's tokens are dropped (a continuation
        computes them again). The sequence stays live: its next step pages back what it selects.
        Its summaries shrink to its chunks' rows: they stay on the device while it is parked."""
        self.truncate(self.seq.n_sealed)
        self.pager.evict(self.resident())
        self.seq.trim_summaries()
        self.host.fence()

    def free(self) -> None:
        """Returns every GPU and host slot of this sequence."""
        # Cleared before taking the lock: a prefetch re-takes it batch after batch (locks are not
        # fair) and would otherwise keep a closing session waiting for the whole document.
        self.pager.fetch = None
        with self.pager.lock:  # waits for the batch in flight
            pass
        self.pager.release(self.seq.chunks)
        if self.staging is not None:
            self.pool.stagings.give(self.staging)
            self.staging = None
