"""PagedKV: one sequence's KV over the shared chunk pool and host tier, under a residency policy.

It implements the model's KVCache interface. Each forward: `begin` picks the resident set for the
step and pages chunks in and out; `attend` writes the step's K/V into its slots and attends over the
resident chunks in logical order; `end` seals chunks that became full (summary, ready to page out).
With a budget that holds the whole context it computes what the dense cache computes (invariant 4).
"""

from __future__ import annotations

import itertools
import math
import threading
import warnings
from collections.abc import Callable, Iterator

import torch

from kvflash import KVFlashError, kernels
from kvflash.config import ResidencyConfig
from kvflash.engine.chunk_index import shared_run
from kvflash.engine.host_tier import BLOCK_SLOTS, HostTier
from kvflash.engine.pool import ChunkPool, summary_shape
from kvflash.engine.residency import required_chunks, select_resident
from kvflash.engine.sequence import Chunk, Sequence
from kvflash.kvcache import sdpa
from kvflash.models.rope import inv_frequencies
from kvflash.storage import ROOT_HASH, chain_hashes

SCORE_BYTES = 64 << 20
"""Logits memory one batch of chunk scoring (exact, or the summaries' estimate) may take."""
DECODE_FIELDS = 6
"""`PagedKV.decode_in`: token id, position, write slot, write offset, chunks listed, valid in the last."""


_in_place_refused: list[Exception] = []
"""Set when the Triton launcher refused a pinned host block's address (`PagedKV._host_lse`)."""

_table_writes = itertools.count()
"""Numbers every write of any sequence's slot table: a batch that holds copies of its sequences'
tables re-copies them only when one of these numbers changed."""


class Staged:
    """A small int32 device buffer written from pinned host memory in one asynchronous copy: a decode
    step's inputs reach the device without the host waiting on it."""

    def __init__(self, shape: tuple[int, ...], device: torch.device):
        cuda = device.type == "cuda"
        self.device = torch.zeros(shape, dtype=torch.int32, device=device)
        self._host = torch.zeros(shape, dtype=torch.int32, pin_memory=cuda)
        self._sent = torch.cuda.Event() if cuda else None

    def send(self, values) -> None:
        """values: anything numpy assigns to the buffer's shape (a [B, F] buffer takes B rows)."""
        if self._sent is not None:
            self._sent.synchronize()  # the previous copy has read the host buffer
        self._host.numpy()[:] = values
        self.device.copy_(self._host, non_blocking=True)
        if self._sent is not None:
            self._sent.record()


Fetch = Callable[[list[str], list[torch.Tensor]], None]
"""Reads stored chunks (by chain hash) into host-tier slot views, in parallel."""


class PagedKV:
    def __init__(
        self,
        pool: ChunkPool,
        host: HostTier,
        cfg: ResidencyConfig,
        budget_chunks: int,
        fingerprint: str | None = None,
    ):
        if cfg.chunk_tokens != pool.chunk_tokens:
            raise KVFlashError(f"chunk_tokens {cfg.chunk_tokens} differs from the pool's {pool.chunk_tokens}")
        if budget_chunks < cfg.floor_chunks() and cfg.policy != "full":
            raise KVFlashError(
                f"a budget of {budget_chunks} chunks is below the floor of {cfg.floor_chunks()} "
                f"(sinks {cfg.sink_chunks} + tail {cfg.tail_chunks} + 2)"
            )
        self.pool, self.host, self.cfg, self.budget = pool, host, cfg, budget_chunks
        self.seq = Sequence(cfg.chunk_tokens)
        self.fetch: Fetch | None = None
        """Reads a lazy restore's chunks into host-tier slots (`adopt`)."""
        self._fetch_lock = threading.Lock()
        self.chain: tuple[str, list[str]] = ("", [])
        """(fingerprint, chain hashes) of the first chunks, as far as they are known (a restore's,
        then each snapshot's): a snapshot hashes only the chunks after them."""
        self.fingerprint = fingerprint
        """The model fingerprint its sealed chunks of exact KV are named under (the engine's):
        named chunks are shared with every sequence whose prompt begins the same (`share`)."""
        self.approximate = False
        """Some step ran without every earlier chunk resident: this KV is not what the dense cache
        computes, and is stored apart from exact KV (snapshots.APPROX_SUFFIX)."""
        self._scout = False
        """This step is a scout (`begin`); False between steps."""
        self._scouted = False
        """The last step was a scout: its scores are the question's, so the next step may select."""
        self._dirty = True
        """Pins changed since the last selection: the next step must select again."""
        self.step = 0
        self.chunk_nbytes = pool.kv[0].numel() * pool.kv.element_size()
        self.moved = {"disk": 0, "host_to_gpu": 0, "gpu_to_host": 0}
        """Bytes of chunk KV moved per tier since the sequence began (for stats lines)."""
        self.uses_triton = kernels.uses_triton(
            pool.kv, head_dim=pool.cfg.head_dim, chunk_tokens=cfg.chunk_tokens
        )
        """Triton kernels on CUDA; elsewhere SDPA over the gathered slots (the same maths)."""
        if self.uses_triton:
            self._init_decode_buffers(budget_chunks)
        self._since_select = 0
        self._scores: torch.Tensor | None = None
        self.queries: list[torch.Tensor] | None = None
        """Each layer's scoring queries, on steps that score the chunks at `end`; a CUDA graph that
        replays such a step hands in the queries it recorded."""
        self._exact = False
        """This step's queries are scored from exact keys (scouts, decode re-selection), not from the
        summaries."""
        self._inv_freq = inv_frequencies(pool.cfg).to(pool.kv.device)
        self._rot: torch.Tensor | None = None
        """[resident, 2, D/2] cos/sin moving each resident chunk's keys to its cache position, or None
        when no resident chunk has evicted chunks between it and the step's queries."""
        self._cand_rot: torch.Tensor | None = None
        """[candidates, 2, D/2]: where each earlier chunk is scored from (`_candidate_rotation`)."""

    def _init_decode_buffers(self, budget: int) -> None:
        """Device buffers every decode step reads, at fixed addresses and one width (the budget), so
        that an eager step and the CUDA graph replaying it launch the same kernels on the same data."""
        dev = self.pool.kv.device
        self._table = torch.zeros(budget, dtype=torch.int32, device=dev)
        """The resident slots in logical order, the first `decode_in[4]` of them valid."""
        self._table_rot = torch.zeros(budget, 2, self.pool.cfg.head_dim // 2, device=dev)
        """Each listed chunk's key rotation (`_cache_rotation`), read when `shifted`."""
        self._staged = Staged((DECODE_FIELDS,), dev)
        self.decode_in = self._staged.device
        self._decode_write = self.decode_in[2:3], self.decode_in[3:4]
        """The slot and offset a decode step writes, as views of `decode_in`."""
        self.decode_fields: tuple[int, ...] = ()
        """This decode step's `decode_in` values, on the host (a batch sends several together)."""
        self.shifted = False
        """The listed chunks' keys are turned (cache positions with chunks evicted between them)."""
        self.table_write = next(_table_writes)
        """The number of the last write of `decode_table` (and of the rotations)."""
        self._no_rot: torch.Tensor | None = None

    @property
    def scout(self) -> bool:
        """The step begun is a scout: it computes scores only, and neither advances the sequence nor
        seals chunks. False between steps."""
        return self._scout

    @property
    def recording(self) -> bool:
        """This step records each layer's query, to score the chunks at `end` (from exact keys in
        scouts and decode re-selection, from the summaries in other prefill steps)."""
        return self.queries is not None and self._n_cand > 0

    def decode_table(self) -> torch.Tensor:
        """[budget] int32: the slot table this decode step reads (`decode_in[4]` of it valid)."""
        return self._table

    def decode_rotation(self) -> torch.Tensor:
        """[budget, 2, D/2]: each listed chunk's key rotation this decode step, the identity (cos 1,
        sin 0) when no key is turned, so that a batch mixing both can run as one kernel call."""
        return self._table_rot if self.shifted else self.identity_rotation()

    def identity_rotation(self) -> torch.Tensor:
        """[budget, 2, D/2] of cos 1, sin 0: turns no key."""
        if self._no_rot is None:
            self._no_rot = torch.zeros_like(self._table_rot)
            self._no_rot[:, 0] = 1.0
        return self._no_rot

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
        if not 0 <= lo < hi:
            raise KVFlashError(f"bad pin range [{lo}, {hi})")
        c = self.cfg.chunk_tokens
        idx = range(lo // c, (hi - 1) // c + 1)
        pinned = {ch.index for ch in self.seq.chunks if ch.pinned} | set(idx)
        if self.cfg.floor_chunks(len(pinned)) > self.budget:
            raise KVFlashError(
                f"pinning {len(pinned)} chunks would break the floor: sinks + tail + pins + 2 = "
                f"{self.cfg.floor_chunks(len(pinned))} > budget {self.budget} chunks (pin less, or a "
                "larger --pool-tokens)"
            )
        self.seq.ensure_chunks(idx[-1] * c + 1)
        for i in idx:
            self.seq.chunks[i].pinned = True
        self._dirty = True

    def unpin(self, lo: int, hi: int) -> None:
        self._dirty = True
        c = self.cfg.chunk_tokens
        for i in range(lo // c, min((hi - 1) // c + 1, len(self.seq.chunks))):
            self.seq.chunks[i].pinned = False

    def unpin_all(self) -> None:
        self._dirty = True
        for ch in self.seq.chunks:
            ch.pinned = False

    # -- residency ---------------------------------------------------------------------------------

    def resident(self) -> list[Chunk]:
        return [c for c in self.seq.chunks if c.gpu is not None]

    def tau(self) -> int:
        return max(self.cfg.tau, len(self.seq) // self.cfg.tau_history_div)

    def _roomy(self) -> bool:
        """Every chunk has stayed resident and the budget holds one more: a decode re-selection (and
        the scoring before it) could not change what is resident, so none is due until this ends."""
        return not self.approximate and len(self.seq.chunks) < self.budget

    def _evict(self, chunks: list[Chunk]) -> None:
        """Sends chunks to the host tier (those without a host copy yet) in one batch, and frees
        their pool slots: a page-in issued after it on the side stream may reuse them."""
        for ch in chunks:
            assert ch.sealed, f"chunk {ch.index} is not sealed and cannot leave the GPU"
        out = [ch for ch in chunks if ch.host is None and not self._share_host(ch)]
        for ch, h in zip(out, self.host.page_out_many([ch.gpu for ch in out]), strict=True):
            ch.host = h
            if ch.key is not None:
                self.host.publish(ch.key, h)
        self.moved["gpu_to_host"] += len(out) * self.chunk_nbytes
        for ch in chunks:
            self.pool.release(ch.gpu)
            ch.gpu = None

    def load_to_host(self, chunks: list[Chunk]) -> None:
        """Brings disk-only chunks into the host tier in one parallel read (selection and prefetch)."""
        with self._fetch_lock:
            fetch = self.fetch  # `free` may clear it without the lock
            todo = [ch for ch in chunks if ch.host is None and ch.gpu is None and ch.disk is not None]
            todo = [ch for ch in todo if not self._share_host(ch)]
            if not todo or fetch is None:
                return
            slots = self.host.alloc_many(len(todo))
            try:
                fetch([ch.disk for ch in todo], [self.host.view(h) for h in slots])
            except BaseException:
                for h in slots:
                    self.host.release(h)
                raise
            for ch, h in zip(todo, slots, strict=True):
                ch.host = h
                if ch.key is not None:
                    self.host.publish(ch.key, h)
            self.moved["disk"] += len(todo) * self.chunk_nbytes

    def chunk_kv(self, index: int) -> torch.Tensor:
        """A sealed chunk's KV `[L, 2, Hkv, C, D]` wherever it lives; a disk-only chunk is read first."""
        ch = self.seq.chunks[index]
        if ch.gpu is None and ch.host is None:
            self.load_to_host([ch])
        return self.pool.kv[ch.gpu] if ch.gpu is not None else self.host.view(ch.host)

    def _share_host(self, ch: Chunk) -> bool:
        """Takes a reference to the host copy of a named chunk where the host tier holds one."""
        if ch.key is not None:
            ch.host = self.host.share(ch.key)
        return ch.host is not None

    def _make_resident(self, chunks: list[Chunk]) -> None:
        """Gives chunks pool slots: a named chunk that some sequence holds in the pool shares its
        slot; the others get new slots, paging in those with host copies in one batch."""
        new = []
        for ch in chunks:
            g = None if ch.key is None else self.pool.index.find(ch.key)
            if g is None:
                new.append(ch)
            else:
                self.pool.share(g)
                ch.gpu = g
        for ch, g in zip(new, self.pool.alloc_many(len(new)), strict=True):
            ch.gpu = g
            if ch.key is not None:
                self.pool.index.add(ch.key, g)
        paged = [ch for ch in new if ch.host is not None]
        self.host.page_in_many([ch.host for ch in paged], [ch.gpu for ch in paged])
        self.moved["host_to_gpu"] += len(paged) * self.chunk_nbytes

    def _apply_scores(self) -> None:
        if self._scores is not None:
            for ch, s in zip(self.seq.chunks, self._scores.tolist(), strict=False):
                ch.score = s
            self._scores = None

    def begin(self, input_ids: torch.Tensor, positions: torch.Tensor, scout: bool = False) -> None:
        """Starts a step of input_ids at positions [T]; a `scout` step scores the chunks for its
        queries and writes nothing the sequence keeps (`end`)."""
        self._begin(input_ids.tolist(), int(positions[0]), positions.numel(), scout=scout)

    def begin_ids(self, ids: list[int], start: int) -> None:
        """`begin` for ids known on the host (a mixed step's piece): reads nothing back."""
        self._begin(ids, start, len(ids))

    def begin_decode(self, token: int, position: int, send: bool = True) -> None:
        """`begin` for one token known on the host: reads nothing back from the device. Without `send`
        the step's inputs stay in `decode_fields`, for a batch that sends its sequences' together."""
        self._begin([token], position, 1, send)

    def _begin(self, ids: list[int], start: int, t: int, send: bool = True, scout: bool = False) -> None:
        self._ids, self._scout = ids, scout
        if start != len(self.seq):
            raise KVFlashError(f"positions start at {start} but the sequence holds {len(self.seq)} tokens")
        end = start + t
        c = self.cfg.chunk_tokens
        self.seq.ensure_chunks(end)
        first, last = start // c, (end - 1) // c
        self._apply_scores()
        # A first scout has no scores for the question yet: it runs on the floor alone (sinks, tail,
        # pins, its own chunks), whatever happens to be resident, so that a restored sequence scouts
        # exactly as a cold one does. A later scout selects with the previous one's scores.
        first_scout = self._scout and not self._scouted
        due = (t > 1 or (self._since_select >= self.tau() and not self._roomy())) and not first_scout
        fast = not (due or first_scout or self._dirty)
        if fast and first == last and self.seq.chunks[first].gpu is not None:
            self._step_metadata(start, end, send)  # decode inside the resident append head: nothing moves
            return
        if first_scout:
            want = required_chunks(self.seq, self.cfg, first, last)
        else:
            # a document's own steps keep what they hold unless a chunk beats it by the margin; the
            # question's steps (scouts, and the step after them) select exactly
            margin = self.cfg.keep_margin if t > 1 and not (self._scout or self._scouted) else 0.0
            want = select_resident(self.seq, self.cfg, self.budget, first, last, due, margin)
        if due:
            self._since_select = 0
        if not self._scout and len(want) <= last:  # want lies in 0..last and holds first..last
            self.approximate = True
        self._evict([ch for ch in self.resident() if ch.index not in want])
        order = sorted(want)
        wanted = [self.seq.chunks[i] for i in order]
        self.load_to_host(wanted)
        self._make_resident([ch for ch in wanted if ch.gpu is None])
        for ch in wanted:
            ch.last_use = self.step
        self.host.fence()
        self._dirty = False
        dev, i32 = self.pool.kv.device, torch.int32
        self._n_listed = len(order)
        self._slots = torch.tensor([self.seq.chunks[i].gpu for i in order], device=dev, dtype=i32)
        self._order = torch.tensor(order, device=dev, dtype=i32)
        self._rot = self._cache_rotation(order, first) if self.cfg.cache_positions else None
        if self.uses_triton:
            self._table[: len(order)].copy_(self._slots)
            self.shifted = self._rot is not None
            if self.shifted:
                self._table_rot[: len(order)].copy_(self._rot)
            self.table_write = next(_table_writes)
        else:
            self._key_pos = (self._order[:, None].long() * c + torch.arange(c, device=dev)).flatten()
        self._step_metadata(start, end, send)

    def _cache_rotation(self, order: list[int], first: int) -> torch.Tensor | None:
        """Each resident chunk moves forward by the evicted chunks between it and the step's first
        chunk (its rank; the step's own chunks are the last, contiguous ranks, so they stay put)."""
        c = self.cfg.chunk_tokens
        gap_q = first - order.index(first)
        shift = [(gap_q - (i - rank)) * c for rank, i in enumerate(order)]
        if not any(shift):
            return None
        return self._rotation(torch.tensor(shift, device=self._inv_freq.device))

    def _candidate_rotation(self, first: int) -> torch.Tensor | None:
        """Under cache positions, the rotation [first, 2, D/2] that scores each earlier chunk where it
        would be attended from if selected: just before the tail, `tail_chunks + 1` chunks before the
        step (nearer chunks stay). Scored at their absolute distance, far chunks lose to near ones by
        RoPE's decay alone, though selected they would sit near."""
        if not self.cfg.cache_positions or not first:
            return None
        c, dev = self.cfg.chunk_tokens, self._inv_freq.device
        near = first - self.cfg.tail_chunks - 1
        return self._rotation((near - torch.arange(first, device=dev)).clamp(min=0) * c)

    def _rotation(self, shift: torch.Tensor) -> torch.Tensor:
        """[n, 2, D/2] cos and sin of each chunk's RoPE angles for a shift of `shift[i]` positions."""
        ang = shift.float()[:, None] * self._inv_freq
        return torch.stack([ang.cos(), ang.sin()], 1)

    def _step_metadata(self, start: int, end: int, send: bool) -> None:
        """Where the step's tokens are written and which keys each query sees; the slot list is kept
        from the last selection (it changes only when residency does)."""
        c, dev, i32 = self.cfg.chunk_tokens, self.pool.kv.device, torch.int32
        chunks = self.seq.chunks
        self._start, self._end = start, end
        t = end - start
        if self.uses_triton and t == 1:
            self._stage_decode(start, send)
        else:
            pos = torch.arange(start, end, device=dev)
            slot_of = [chunks[p // c].gpu for p in range(start, end)]
            self._w_slot = torch.tensor(slot_of, device=dev, dtype=i32)
            self._w_off = (pos % c).to(i32)
            if not self.uses_triton:
                self._mask = self._key_pos[None, :] <= pos[:, None]
        self._n_cand = start // c
        due_next = self._since_select + t >= self.tau() and not self._roomy()
        capture = self.cfg.policy == "qk" and (self._scout or t > 1 or due_next)
        self._cand_rot = self._candidate_rotation(start // c) if capture else None
        self._exact = capture and (self._scout or t == 1)
        self.queries = [] if capture else None

    def _stage_decode(self, position: int, send: bool) -> None:
        """A decode step's inputs: the slot and offset it writes, the chunks listed and the valid tokens
        in the last (the append head holds this one), sent to `decode_in` in one copy if `send`."""
        c = self.cfg.chunk_tokens
        slot, off = self.seq.chunks[position // c].gpu, position % c
        self.decode_fields = (self._ids[0], position, slot, off, self._n_listed, off + 1)
        if send:
            self._staged.send(self.decode_fields)
        self._w_slot, self._w_off = self._decode_write

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv = self.pool.kv
        kernels.write_tokens(kv, layer, self._w_slot, self._w_off, k, v)
        if self.queries is not None and self._n_cand:
            self.queries.append(q[-self.cfg.score_queries :].float())
        if self.uses_triton:
            return self._attend_triton(layer, q)
        # K/V in the pool's dtype are read in q's (the model's) dtype: a 16-bit KV under an fp32
        # model attends in fp32, as the reference twins do (fp8 KV: its values, in fp32).
        h_kv, d = kv.shape[3], kv.shape[5]
        kv = kernels.reference.kv_values(kv[self._slots, layer])  # [n, 2, Hkv, C, D]
        keys = kv[:, 0].transpose(0, 1)  # [Hkv, n, C, D]
        if self._rot is not None:
            keys = kernels.reference.shift_keys(keys, self._rot)
        keys = keys.reshape(h_kv, -1, d).to(q.dtype)
        values = kv[:, 1].transpose(0, 1).reshape(h_kv, -1, d).to(q.dtype)
        return sdpa(q, keys, values, self._mask)

    def _attend_triton(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        scale = q.shape[-1] ** -0.5
        if q.shape[0] == 1:
            ins, rot = self.decode_in, self._table_rot[None] if self.shifted else None
            return kernels.paged_decode_attention(
                q, self.pool.kv, layer, self._table[None], ins[4:5], ins[5:6], scale, rot
            )
        return kernels.prefill_attention(
            q, self.pool.kv, layer, self._slots, self._order, self._start, scale, self._rot
        )

    def _estimated_scores(self) -> torch.Tensor:
        """The attention mass each chunk would get, estimated from its summaries (prefill steps).

        Each block mean key stands in for its tokens; a softmax over all blocks of all candidate
        chunks gives every (query token, head) a distribution, and a chunk scores the largest share
        any of them gives it, summed over layers. Summed shares would favour chunks that everyone
        looks at a little; the max finds the chunk one retrieval head looks at a lot
        (docs/ARCHITECTURE.md, Residency). The layers' recorded queries are scored together, as many
        layers a batch as SCORE_BYTES of logits allow: a few launches a step instead of ~20 a layer.
        """
        qs = torch.stack(self.queries)  # [L, t, Hq, D]
        scores = torch.zeros(self._n_cand, device=qs.device)
        for _, _, lse in self._estimates(qs, self.seq.summaries[: self._n_cand], self._cand_rot):
            scores += self._mass(lse).sum(0)
        return scores

    def _estimates(
        self, qs: torch.Tensor, summ: torch.Tensor, rot: torch.Tensor | None
    ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(lo, hi, log-masses [hi - lo, t, Hq, N]) for layers lo..hi-1: `_estimate_lse` of the
        queries qs [L, t, Hq, D] over summaries [N, L, Hkv, B, D] turned by rot, as many layers at a
        time as SCORE_BYTES of logits allow."""
        n_layers, t, hq, _ = qs.shape
        step = max(1, SCORE_BYTES // (t * hq * summ.shape[0] * summ.shape[3] * 4))
        for lo in range(0, n_layers, step):
            hi = min(lo + step, n_layers)
            yield lo, hi, self._estimate_lse(qs[lo:hi], _turned(summ[:, lo:hi], rot))

    def _estimate_lse(self, qs: torch.Tensor, summ: torch.Tensor) -> torch.Tensor:
        """log Σ exp(q·k/√d) over each chunk's tokens, with every block's tokens at its mean key.

        qs [L', t, Hq, D], summaries [N, L', Hkv, B, D] of the same layers -> [L', t, Hq, N]."""
        n, _, h_kv, blocks, d = summ.shape
        qs = qs.view(*qs.shape[:2], h_kv, -1, d)
        logits = torch.einsum("lthgd,nlhbd->lthgnb", qs, summ) * d**-0.5
        return (logits.logsumexp(-1) + math.log(self.cfg.chunk_tokens // blocks)).flatten(2, 3)

    @staticmethod
    def _mass(lse: torch.Tensor) -> torch.Tensor:
        """[L, t, Hq, N] chunk log-masses -> [L, N]: the largest softmax share any query and head gives
        each chunk, per layer."""
        return torch.softmax(lse, dim=-1).flatten(1, 2).amax(1)

    def _exact_scores(self, from_host: bool) -> torch.Tensor:
        """Scores from the keys themselves, for the queries this step recorded in every layer.

        A block mean key underrates a block holding one sharply matching key (exp is convex), which is
        what a needle looks like, so the question's scouts score from exact keys: chunks on the GPU
        and in the host tier read where they are (`from_host`, `_host_lse`), disk-only chunks (a
        lazy restore) at their summaries' estimate. Decode re-selection reads only the GPU.
        """
        qs = torch.stack(self.queries)  # [L, t, Hq, D]
        n_layers, t, hq, _ = qs.shape
        dev, i32 = qs.device, torch.int32
        lse = torch.empty(n_layers, t, hq, self._n_cand, device=dev)
        chunks = self.seq.chunks[: self._n_cand]
        on_gpu = [ch for ch in chunks if ch.gpu is not None]
        on_host = [ch for ch in chunks if ch.gpu is None and ch.host is not None] if from_host else []
        rest = [ch.index for ch in chunks if ch.gpu is None and not (from_host and ch.host is not None)]
        # The twin holds a batch's logits in fp32; the kernel reads keys in place and holds none.
        twin = max(1, SCORE_BYTES // (n_layers * t * hq * self.cfg.chunk_tokens * 4))
        gpu_batch = max(1, len(on_gpu)) if self.uses_triton else twin
        for lo in range(0, len(on_gpu), gpu_batch):
            part = on_gpu[lo : lo + gpu_batch]
            slots = torch.tensor([ch.gpu for ch in part], device=dev, dtype=i32)
            idx = torch.tensor([ch.index for ch in part], device=dev)
            lse[..., idx] = kernels.chunk_lse(qs, self.pool.kv, slots, self._rows(self._cand_rot, idx))
        for b, part in self._by_block(on_host, BLOCK_SLOTS if self.uses_triton else twin):
            slots = torch.tensor([ch.host % BLOCK_SLOTS for ch in part], device=dev, dtype=i32)
            idx = torch.tensor([ch.index for ch in part], device=dev)
            lse[..., idx] = self._host_lse(qs, self.host.block(b), slots, self._rows(self._cand_rot, idx))
        if rest:
            summ = self.seq.summaries[torch.tensor(rest, device=dev)]
            for lo, hi, part in self._estimates(qs, summ, self._rows(self._cand_rot, rest)):
                lse[lo:hi, ..., rest] = part
        return self._mass(lse).mean(0)

    @staticmethod
    def _rows(rot: torch.Tensor | None, index) -> torch.Tensor | None:
        return None if rot is None else rot[index]

    @staticmethod
    def _by_block(chunks: list[Chunk], batch: int) -> Iterator[tuple[int, list[Chunk]]]:
        """Host-tier chunks grouped by the block holding them, at most `batch` a group."""
        blocks: dict[int, list[Chunk]] = {}
        for ch in chunks:
            blocks.setdefault(ch.host // BLOCK_SLOTS, []).append(ch)
        for b, part in blocks.items():
            for lo in range(0, len(part), batch):
                yield b, part[lo : lo + batch]

    def _host_lse(
        self, qs: torch.Tensor, block: torch.Tensor, slots: torch.Tensor, rot: torch.Tensor | None
    ) -> torch.Tensor:
        """`kernels.chunk_lse` over chunks of a host-tier block: where the Triton kernels run they
        read the keys in place over the bus (pinned memory is addressable from the GPU), the keys
        alone and once; elsewhere the block's chunks are copied to the queries' device first."""
        n = slots.numel()
        if block.device == qs.device:  # on the CPU the host tier is the queries' own memory
            return kernels.chunk_lse(qs, block, slots, rot)
        if self.uses_triton and block.is_pinned() and not _in_place_refused:
            try:
                out = kernels.chunk_lse_in_place(qs, block, slots, rot)
            except ValueError as e:  # Triton could not address the block: stage it, and say so once
                _in_place_refused.append(e)
                warnings.warn(f"host-tier chunks are staged to score them: {e}", stacklevel=2)
            else:
                self.moved["host_to_gpu"] += n * self.chunk_nbytes // 2
                return out
        block = block[slots.cpu().long()].to(qs.device)
        slots = torch.arange(n, device=qs.device, dtype=torch.int32)
        self.moved["host_to_gpu"] += n * self.chunk_nbytes
        return kernels.chunk_lse(qs, block, slots, rot)

    def end(self) -> None:
        scout, self._scout = self._scout, False
        self.step += 1
        self._scouted = scout
        if self.queries:
            self._scores = self._exact_scores(scout) if self._exact else self._estimated_scores()
        self.queries = None
        if scout:
            return
        self.seq.tokens.extend(self._ids)
        c = self.cfg.chunk_tokens
        old_sealed = self._start // c
        self._since_select += self._end - self._start
        new_sealed = self._end // c
        if new_sealed > old_sealed:
            self._seal(self.seq.chunks[old_sealed:new_sealed])

    def _seal(self, chunks: list[Chunk]) -> None:
        slots = torch.tensor([ch.gpu for ch in chunks], device=self.pool.kv.device, dtype=torch.int32)
        summaries = kernels.chunk_summaries(self.pool.kv, slots, self.cfg.summary_blocks)
        for ch, summary in zip(chunks, summaries, strict=True):
            self.seq.set_summary(ch.index, summary)
            ch.sealed = True
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
        self.approximate = approximate
        self.chain = (fp, list(hashes))
        if fetch is not None:
            self.fetch = fetch
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

    def share(self, ids: list[int], keys: list[str]) -> int:
        """Takes into this empty sequence the longest run of ids' whole chunks, named by `keys`
        (their chain hashes under `fingerprint`), that some sequence holds as exact KV in the pool
        or the host tier, as references to those slots: the pool slot where the chunk is resident,
        else its host copy. The slots are sealed, so no sequence writes them; each reader evicts or
        drops its own reference. Summaries are computed again from the keys. Returns the tokens
        taken."""
        assert not len(self.seq), "share needs an empty sequence"
        c, fp = self.cfg.chunk_tokens, self.fingerprint
        n = shared_run(keys, self.pool.index.find, self.host.find)
        if not n:
            return 0
        self.seq.ensure_chunks(n * c)
        self.seq.tokens.extend(ids[: n * c])
        for ch, key in zip(self.seq.chunks, keys[:n], strict=True):
            g = self.pool.index.find(key)
            if g is not None:
                self.pool.share(g)
                ch.gpu = g
            else:
                ch.host = self.host.share(key)
            ch.key, ch.sealed = key, True
        self.seq.set_summaries(self._summaries(self.seq.chunks))
        self.chain = (fp, keys[:n])
        self._dirty = True
        return n * c

    def _summaries(self, chunks: list[Chunk]) -> torch.Tensor:
        """[n, *summary_shape] of sealed chunks from their keys: in place in the pool, host copies
        staged to the pool's device a block at a time."""
        dev, blocks, i32 = self.pool.kv.device, self.cfg.summary_blocks, torch.int32
        out = torch.empty((len(chunks), *self.summary_shape), device=dev)
        on_gpu = [i for i, ch in enumerate(chunks) if ch.gpu is not None]
        if on_gpu:
            slots = torch.tensor([chunks[i].gpu for i in on_gpu], device=dev, dtype=i32)
            out[on_gpu] = kernels.chunk_summaries(self.pool.kv, slots, blocks)
        on_host = [i for i, ch in enumerate(chunks) if ch.gpu is None]
        self.host.fence()  # a page-out still copying is read after it lands
        for lo in range(0, len(on_host), BLOCK_SLOTS):
            part = on_host[lo : lo + BLOCK_SLOTS]
            staged = torch.stack([self.host.view(chunks[i].host).to(dev) for i in part])
            rows = torch.arange(len(part), device=dev, dtype=i32)
            out[part] = kernels.chunk_summaries(staged, rows, blocks)
        return out

    def truncate(self, n_chunks: int) -> None:
        """Keeps the first n_chunks chunks (sealed) and drops every later token, giving back the
        dropped chunks' slots: a prompt that shares only that prefix with this sequence reuses it.
        A kept chunk's KV depends only on the tokens before it, so it is what a prefill of the prompt
        would compute (under the same residency); the next step selects again."""
        assert n_chunks <= self.seq.n_sealed, "only whole sealed chunks can be kept"
        with self._fetch_lock:  # a prefetch in flight finishes its batch first
            dropped = self.seq.chunks[n_chunks:]
            for ch in dropped:
                ch.disk = None  # a prefetch that listed it no longer reads it
            self._release(dropped)
            del self.seq.chunks[n_chunks:]
            del self.seq.tokens[n_chunks * self.cfg.chunk_tokens :]
            del self.chain[1][n_chunks:]
        self._scores, self._scouted, self._dirty, self._since_select = None, False, True, 0

    def park(self) -> None:
        """Leaves the pool for the host tier while idle: whole chunks are paged out (a chunk that
        has a host copy keeps it), the last partial chunk's tokens are dropped (a continuation
        computes them again). The sequence stays live: its next step pages back what it selects.
        Its summaries shrink to its chunks' rows: they stay on the device while it is parked."""
        self.truncate(self.seq.n_sealed)
        self._evict(self.resident())
        self.seq.trim_summaries()
        self.host.fence()

    def free(self) -> None:
        """Returns every GPU and host slot of this sequence."""
        # Cleared before taking the lock: a prefetch re-takes it batch after batch (locks are not
        # fair) and would otherwise keep a closing session waiting for the whole document.
        self.fetch = None
        with self._fetch_lock:  # waits for the batch in flight
            pass
        self._release(self.seq.chunks)

    def _release(self, chunks: list[Chunk]) -> None:
        for ch in chunks:
            if ch.gpu is not None:
                self.pool.release(ch.gpu)
                ch.gpu = None
            if ch.host is not None:
                self.host.release(ch.host)
                ch.host = None


def _turned(keys: torch.Tensor, rot: torch.Tensor | None) -> torch.Tensor:
    """Keys or block means [n, L, Hkv, X, D] of n chunks turned by rot [n, 2, D/2] (None: as they are)."""
    if rot is None:
        return keys
    return kernels.reference.shift_keys(keys.float().movedim(0, 2), rot).movedim(2, 0)
