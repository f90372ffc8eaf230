"""PagedKV: one sequence's KV over the shared chunk pool and host tier, under a residency policy.

It implements the model's KVCache interface. Each forward: `begin` picks the resident set for the
step and pages chunks in and out; `attend` writes the step's K/V into its slots and attends over the
resident chunks in logical order; `end` seals chunks that became full (summary, ready to page out).
With a budget that holds the whole context it computes what the dense cache computes (invariant 4).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflash import KVFlashError
from kvflash.config import ResidencyConfig
from kvflash.host_tier import HostTier
from kvflash.pool import ChunkPool
from kvflash.residency import select_resident
from kvflash.sequence import Chunk, Sequence


class PagedKV:
    def __init__(self, pool: ChunkPool, host: HostTier, cfg: ResidencyConfig, budget_chunks: int):
        if cfg.chunk_tokens != pool.chunk_tokens:
            raise KVFlashError(f"chunk_tokens {cfg.chunk_tokens} differs from the pool's {pool.chunk_tokens}")
        if budget_chunks < cfg.floor_chunks() and cfg.policy != "full":
            raise KVFlashError(
                f"a budget of {budget_chunks} chunks is below the floor of {cfg.floor_chunks()} "
                f"(sinks {cfg.sink_chunks} + tail {cfg.tail_chunks} + 2)"
            )
        self.pool, self.host, self.cfg, self.budget = pool, host, cfg, budget_chunks
        self.seq = Sequence(cfg.chunk_tokens)
        self.scout = False
        """A scout step computes scores only: it neither advances the sequence nor seals chunks."""
        self.step = 0
        self._since_select = 0
        self._scores: torch.Tensor | None = None

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
                f"{self.cfg.floor_chunks(len(pinned))} > budget {self.budget} chunks"
            )
        self.seq.ensure_chunks(idx[-1] * c + 1)
        for i in idx:
            self.seq.chunks[i].pinned = True

    def unpin(self, lo: int, hi: int) -> None:
        c = self.cfg.chunk_tokens
        for i in range(lo // c, min((hi - 1) // c + 1, len(self.seq.chunks))):
            self.seq.chunks[i].pinned = False

    def unpin_all(self) -> None:
        for ch in self.seq.chunks:
            ch.pinned = False

    # -- residency ---------------------------------------------------------------------------------

    def resident(self) -> list[Chunk]:
        return [c for c in self.seq.chunks if c.gpu is not None]

    def tau(self) -> int:
        return max(self.cfg.tau, len(self.seq) // self.cfg.tau_history_div)

    def _evict(self, ch: Chunk) -> None:
        assert ch.sealed, f"chunk {ch.index} is not sealed and cannot leave the GPU"
        if ch.host is None:
            ch.host = self.host.page_out(ch.gpu)
        self.pool.release(ch.gpu)
        ch.gpu = None

    def _make_resident(self, ch: Chunk) -> None:
        ch.gpu = self.pool.alloc()
        if ch.host is not None:
            self.host.page_in(ch.host, ch.gpu)

    def _apply_scores(self) -> None:
        if self._scores is not None:
            for ch, s in zip(self.seq.chunks, self._scores.tolist(), strict=False):
                ch.score = s
            self._scores = None

    def begin(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        self._ids = input_ids.tolist()
        t = positions.numel()
        start = int(positions[0])
        if start != len(self.seq):
            raise KVFlashError(f"positions start at {start} but the sequence holds {len(self.seq)} tokens")
        end = start + t
        c = self.cfg.chunk_tokens
        self.seq.ensure_chunks(end)
        first, last = start // c, (end - 1) // c
        self._apply_scores()
        due = t > 1 or self._since_select >= self.tau()
        want = select_resident(self.seq, self.cfg, self.budget, first, last, reselect=due)
        if due:
            self._since_select = 0
        for ch in self.resident():
            if ch.index not in want:
                self._evict(ch)
        for i in sorted(want):
            ch = self.seq.chunks[i]
            if ch.gpu is None:
                self._make_resident(ch)
            ch.last_use = self.step
        self.host.fence()
        self._build_metadata(positions, sorted(want))

    def _build_metadata(self, positions: torch.Tensor, order: list[int]) -> None:
        c, dev = self.cfg.chunk_tokens, self.pool.kv.device
        chunks = self.seq.chunks
        self._slots = torch.tensor([chunks[i].gpu for i in order], device=dev)
        pos = positions.to(dev)
        self._w_slot = self._slots.new_tensor([chunks[p // c].gpu for p in positions.tolist()])
        self._w_off = pos % c
        key_pos = (torch.tensor(order, device=dev)[:, None] * c + torch.arange(c, device=dev)).flatten()
        self._mask = key_pos[None, :] <= pos[:, None]
        self._start, self._end = int(positions[0]), int(positions[-1]) + 1
        self._n_cand = self._start // c
        t = self._end - self._start
        capture = self.cfg.policy == "qk" and (self.scout or t > 1 or self._since_select + t >= self.tau())
        if capture:
            self._scores = torch.zeros(self._n_cand, device=dev)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv = self.pool.kv
        kv[:, layer, 0][self._w_slot, :, self._w_off] = k
        kv[:, layer, 1][self._w_slot, :, self._w_off] = v
        if self._scores is not None and self._n_cand:
            self._score(layer, q)
        h_kv, d = kv.shape[3], kv.shape[5]
        keys = kv[self._slots, layer, 0].transpose(0, 1).reshape(h_kv, -1, d)
        values = kv[self._slots, layer, 1].transpose(0, 1).reshape(h_kv, -1, d)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=self._mask,
            enable_gqa=True,
        )
        return out.squeeze(0).transpose(0, 1)

    def _score(self, layer: int, q: torch.Tensor) -> None:
        """Adds this layer's max over (query tokens, query heads) of cos(q, chunk summary)."""
        summ = self.seq.summaries[: self._n_cand, layer]  # [N, Hkv, D], unit norm
        h_kv = summ.shape[1]
        qs = F.normalize(q[-self.cfg.score_queries :].float(), dim=-1)
        qs = qs.view(qs.shape[0], h_kv, -1, qs.shape[-1])  # [t, Hkv, G, D]
        cos = torch.einsum("thgd,nhd->nthg", qs, summ)
        self._scores += cos.flatten(1).amax(1) / self.pool.cfg.n_layers

    def end(self) -> None:
        self.step += 1
        if self.scout:
            return
        self.seq.tokens.extend(self._ids)
        c = self.cfg.chunk_tokens
        old_sealed = self._start // c
        self._since_select += self._end - self._start
        new_sealed = self._end // c
        for i in range(old_sealed, new_sealed):
            self._seal(self.seq.chunks[i])

    def _seal(self, ch: Chunk) -> None:
        keys = self.pool.kv[ch.gpu, :, 0].float().mean(dim=2)  # [L, Hkv, D]
        self.seq.set_summary(ch.index, F.normalize(keys, dim=-1))
        ch.sealed = True

    def free(self) -> None:
        """Returns every GPU and host slot of this sequence."""
        for ch in self.seq.chunks:
            if ch.gpu is not None:
                self.pool.release(ch.gpu)
                ch.gpu = None
            if ch.host is not None:
                self.host.release(ch.host)
                ch.host = None
