"""The engine: a model plus the shared chunk pool and host tier, and the prefill/decode loops over them.

Prefill of a prompt longer than a sequence's budget runs in whole-chunk steps; under `qk` the last
step is first run as scouts whose queries score the chunks, so that the question at the end of a
prompt chooses which chunks of the document it attends to.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property

import torch

from kvflash import kernels
from kvflash.config import KV_DTYPE_NAMES, EngineConfig, resolve_kv_dtype
from kvflash.engine.batch_kv import BatchKV, padded_size
from kvflash.engine.decode_graph import BatchGraphs
from kvflash.engine.generate import Generation, Sampler, Sampling, Step, decode, eager_step
from kvflash.engine.host_tier import HostTier
from kvflash.engine.paged_kv import PagedKV
from kvflash.engine.pool import ChunkPool, slots_for
from kvflash.engine.step import MixedKV, Piece, Prefill
from kvflash.engine.to_device import on_device
from kvflash.models.loader import LoadedModel

WARM_PIECES = (24, 48, 100)
"""Prefill pieces the warm-up runs after a whole step: one of each query-tile size the prefill
kernel picks for short pieces (32, 64 and 128 rows), the shapes of a conversation's next turns."""
STEP_ACTIVATION_BYTES = 1 << 30
"""Device memory a default prefill step's activations take at most (the residual stream, the
normed copy and the MLP's three intermediate tensors): half what `--pool-tokens auto` leaves free
(`pool.slots_for`), so a larger step never makes an automatic pool run out of memory. SmolLM2's
steps are 32,768 tokens, an 8B Llama's 9,024."""


class Engine:
    def __init__(self, lm: LoadedModel, cfg: EngineConfig, warm: bool = True):
        """`warm`: run `warm_up` now where it applies (CUDA); a caller with other start-up work to
        overlap with it passes False and calls `warm_up` itself."""
        self.lm, self.cfg = lm, cfg
        self.kv_dtype = resolve_kv_dtype(cfg.kv_dtype, lm.dtype, lm.device)
        c = cfg.residency.chunk_tokens
        blocks, dt = cfg.residency.summary_blocks, self.kv_dtype
        n = slots_for(lm.config, cfg.pool_tokens, c, dt, lm.device, summary_blocks=blocks)
        self.pool = ChunkPool(lm.config, n, c, dt, lm.device)
        self.host = HostTier(self.pool, cfg.host_bytes)
        self.batch_graphs = BatchGraphs(lm.model)
        self._batches: dict[tuple[int, int], BatchKV] = {}
        self._no_logits = torch.empty(0, lm.config.vocab_size, device=lm.device)
        if warm:
            self.warm_up()

    @cached_property
    def fingerprint(self) -> str:
        """The model fingerprint of this engine's KV (its dtype and chunk size included): what its
        snapshots are stored and looked up under."""
        return self.lm.fingerprint(self.cfg.residency.chunk_tokens, self.kv_dtype)

    @property
    def kv_dtype_name(self) -> str:
        """The KV dtype as `--kv-dtype` names it (fp32, bf16, fp16, fp8)."""
        return next(name for name, dt in KV_DTYPE_NAMES.items() if dt == self.kv_dtype)

    def other_kv_fingerprints(self) -> dict[str, str]:
        """The fingerprints of this model's KV in each other dtype (this chunk size), to the dtype's
        name: snapshots under them are this model's, with KV this engine does not restore."""
        c = self.cfg.residency.chunk_tokens
        return {
            self.lm.fingerprint(c, dt): name for name, dt in KV_DTYPE_NAMES.items() if dt != self.kv_dtype
        }

    def warm_up(self) -> None:
        """A prefill and decode steps on scratch sequences: one of the pool's budget, whose prefill
        runs a whole step (`step_tokens`, the shape long prompts use) and then short ones, and
        under an evicting policy one over a small budget, whose steps page chunks out and in, score
        them and scout. A process's first CUDA calls (cuBLAS handles and its choice per matrix shape,
        Triton kernels compiled or loaded from the cache, pinned host memory) are slow; warmed here,
        they are part of starting the engine instead of the first turn's time to first token; every
        variant of the prefill and scoring kernels is compiled or loaded first (`kernels.warm`), as
        the steps below reach only the variants of their own shapes."""
        if self.lm.device.type != "cuda":  # the first calls cost little there
            return
        c = self.cfg.residency.chunk_tokens
        kernels.warm(self.pool.kv, self.lm.config.n_heads, self.lm.dtype)
        kv = self.new_sequence()
        try:
            whole = min(self.step_tokens, (self.pool.n_slots - 1) * c)
            logits = self.prefill(kv, [0] * (max(whole, 2 * c) + 1))
            for n in WARM_PIECES:  # the query tiles of short pieces over a long context (turn 2)
                if len(kv.seq) + n < kv.budget * c:
                    logits = self.prefill(kv, [0] * n)
            # captures the graph a lone sequence of the pool's budget replays (the first capture in a
            # process is the slow one)
            gen = Generation(2, Sampler(Sampling(), self.lm.device))
            decode(self.decode_step(kv), logits, len(kv.seq), gen)
        finally:
            kv.free()
        if self.cfg.residency.policy != "full":
            kv = self.new_sequence((self.cfg.residency.floor_chunks() + 3) * c)
            try:
                self.prefill(kv, [0] * ((kv.budget + 4) * c + 1))
            finally:
                kv.free()

    def warm_batches(self, max_batch: int, budget_tokens: int) -> None:
        """Captures the decode graphs a scheduler of up to `max_batch` sequences of this budget
        replays (one per padded batch size), on scratch sequences of one token each, and compiles
        the decode kernel's variants its mixed steps launch outside the graphs, so that no request
        waits for a capture or a compile."""
        seqs = [self.new_sequence(budget_tokens) for _ in range(max_batch)]
        try:
            if not all(map(self.replays, seqs)):
                return
            hq, budget = self.lm.config.n_heads, seqs[0].budget
            kernels.warm_decode(self.pool.kv, hq, self.lm.dtype, max_batch, budget)
            for kv in seqs:
                self.prefill(kv, [0])
            sizes = sorted({padded_size(n) for n in range(1, max_batch + 1)})
            for n in sizes:
                self.decode_batch(seqs[:n], [0] * n)
        finally:
            for kv in seqs:
                kv.free()

    def expect(self, tokens: int) -> None:
        """Starts pinning host memory for the chunks beyond the pool of a prompt of about `tokens`
        tokens, before its ids exist (while a document is tokenised): its prefill's page-outs then
        find the memory pinned instead of waiting for it. The prefill reserves what is still short."""
        leaving = -(-tokens // self.cfg.residency.chunk_tokens) - self.pool.n_slots
        if leaving > 0:
            self.host.reserve(self.host.n_used + leaving)

    def sequence_budget(self, budget_tokens: int | None = None) -> int:
        """The chunks a sequence of `budget_tokens` (None: the pool) holds in the pool."""
        c = self.cfg.residency.chunk_tokens
        return min(self.pool.n_slots if budget_tokens is None else -(-budget_tokens // c), self.pool.n_slots)

    def new_sequence(self, budget_tokens: int | None = None) -> PagedKV:
        budget, c = self.sequence_budget(budget_tokens), self.cfg.residency.chunk_tokens
        # a step writes up to a chunk boundary: at most `step_tokens // c` chunks past its first
        step_chunks = max(1, self.step_tokens // c) + 1
        return PagedKV(self.pool, self.host, self.cfg.residency, budget, self.fingerprint, step_chunks)

    @property
    def step_tokens(self) -> int:
        """The most tokens one prefill step computes: `prefill_step_tokens`, else on CUDA as many as
        STEP_ACTIVATION_BYTES holds activations for, 8,192 to 32,768 (a step's launches and host work
        cost the same whatever its tokens: the prompts of many requests admitted together then share
        few steps, docs/BENCHMARKS.md: Serving many conversations), and 512 elsewhere (the
        reference attention holds a step's [tokens, keys] scores per head in memory)."""
        if self.cfg.prefill_step_tokens is not None:
            return self.cfg.prefill_step_tokens
        if self.lm.device.type != "cuda":
            return 512
        m = self.lm.config
        per_token = (4 * m.hidden_size + 3 * m.intermediate_size) * self.lm.dtype.itemsize
        return max(8192, min(32768, STEP_ACTIVATION_BYTES // per_token // 64 * 64))

    def step_chunks(self, kv: PagedKV, remaining: int) -> int:
        """Chunks the next prefill step may write, `remaining` tokens still to go.

        Launches and re-selection are paid per step, so steps are as large as the pool allows (up to
        `prefill_step_tokens`): a sequence that fits its budget takes the room it has; one that evicts
        gives a step half the room above the floor, so the other half holds the chunks its queries
        select (sinks, tail and pins are the floor)."""
        c = kv.cfg.chunk_tokens
        cap = max(1, self.step_tokens // c)
        if -(-(len(kv.seq) + remaining) // c) <= kv.budget:
            return cap
        room = kv.budget - kv.cfg.floor_chunks(kv.n_pinned) + 1
        return max(1, min(cap, room // 2 + 1))

    def prefill(
        self, kv: PagedKV, ids: list[int], on_progress: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """Appends ids to the sequence; returns the logits [V] after the last one."""
        prefill = self.plan_prefill(kv, ids, on_progress)
        while True:
            piece = prefill.next()
            logits = self.forward([], [], [piece])[1][0]
            prefill.ran(piece)
            if piece.final:
                return logits

    def plan_prefill(
        self, kv: PagedKV, ids: list[int], on_progress: Callable[[int], None] | None = None
    ) -> Prefill:
        """The prefill of ids into kv, a piece at a time (`Prefill`), for `forward` to run: alone, or
        in one step with other sequences' pieces and decode tokens. Host memory for the chunks it
        will page out starts pinning now, while its first pieces run."""
        leaving = -(-(len(kv.seq) + len(ids)) // kv.cfg.chunk_tokens) - kv.budget
        if leaving > 0:
            self.host.reserve(self.host.n_used + leaving)
        return Prefill(self.step_chunks, self._scout, kv, ids, on_progress)

    def _scout(self, piece: Piece) -> None:
        """Runs a prompt's last piece as scouts: their queries score the chunks (nothing is written)."""
        for _ in range(piece.kv.cfg.scout_rounds):
            self._alone(piece, scout=True)

    @torch.inference_mode()
    def _alone(self, piece: Piece, scout: bool = False) -> torch.Tensor:
        """A lone piece's step (or a scout of it), its logits after its last id [1, V]. Its ids are
        known on the host, so its sequence plans the step from them (`begin_ids`) instead of reading
        the device's copy back, which would wait for every step launched before it."""
        ids, positions = self._inputs(piece)
        piece.kv.begin_ids(piece.ids, piece.start, scout)
        logits = self.lm.model.compute(ids, positions, piece.kv)
        piece.kv.end()
        return logits

    def _inputs(self, piece: Piece) -> tuple[torch.Tensor, torch.Tensor]:
        """A lone piece's ids and positions [T] on the device."""
        dev = self.lm.device
        return on_device(piece.ids, torch.long, dev), torch.arange(
            piece.start, piece.start + len(piece.ids), device=dev
        )

    def forward(
        self, seqs: list[PagedKV], tokens: list[int] | torch.Tensor, pieces: list[Piece]
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One step: tokens[i] goes next in seqs[i] (ids, or a tensor of them on the device:
        `BatchKV.begin_decode`) and each piece's ids into its sequence, in one forward (`MixedKV`).
        Returns the decode logits [B, V] (None without seqs) and the logits after each piece's last
        id [P, V]. A lone piece runs as a prefill step, a step of decode tokens alone as
        `decode_batch`."""
        if not pieces:
            return self.decode_batch(seqs, tokens), self._no_logits
        if not seqs and len(pieces) == 1:
            return None, self._alone(pieces[0])
        with torch.inference_mode():
            mixed = MixedKV(self._batch(seqs) if seqs else None, pieces)
            ids, positions, rows = mixed.begin(tokens)
            logits = self.lm.model.compute(ids, positions, mixed, rows=rows)
            mixed.end()
        b = len(seqs)
        return (logits[:b] if seqs else None), logits[b:]

    def replays(self, kv: PagedKV) -> bool:
        """Whether this sequence's decode steps replay CUDA graphs: where the Triton kernels run."""
        return self.cfg.cuda_graphs and kv.uses_triton and kv.pool.kv.is_cuda

    def decode_step(self, kv: PagedKV) -> Step:
        """Replayed from the CUDA graphs of a batch of one where `replays` (its logits valid until the
        next step), else the eager forward."""
        if not self.replays(kv):
            return eager_step(self.lm.model, kv)
        return lambda token, position: self.batch_graphs(self._batch([kv]), [token], [position])[0]

    def decode_batch(self, seqs: list[PagedKV], tokens: list[int] | torch.Tensor) -> torch.Tensor:
        """One decode step of each sequence in one forward: tokens[i] goes next in seqs[i] (as in
        `forward`); returns the logits [B, V] after each (valid until the next step). Replayed from a
        CUDA graph of the batch where every sequence `replays` and all have one budget."""
        positions = [len(kv.seq) for kv in seqs]
        if all(map(self.replays, seqs)) and len({kv.budget for kv in seqs}) == 1:
            return self.batch_graphs(self._batch(seqs, padded_size(len(seqs))), tokens, positions)
        if len(seqs) == 1 and not isinstance(tokens, torch.Tensor):
            return self.decode_step(seqs[0])(tokens[0], positions[0])[None]
        return self.decode_batch_eager(seqs, tokens)

    @torch.inference_mode()
    def decode_batch_eager(self, seqs: list[PagedKV], tokens: list[int] | torch.Tensor) -> torch.Tensor:
        """`decode_batch` without graphs: the forward launched from Python."""
        batch = self._batch(seqs)
        batch.begin_decode(tokens, [len(kv.seq) for kv in seqs])
        logits = self.lm.model.compute(*batch.inputs(), batch, all_logits=True)
        batch.end()
        return logits

    def _batch(self, seqs: list[PagedKV], rows: int | None = None) -> BatchKV:
        """The BatchKV of this many rows (`seqs`, then pad rows) and budget, whose buffers (and the
        graphs reading them) serve every step of that shape, now over `seqs`."""
        shape = rows or len(seqs), seqs[0].budget
        batch = self._batches.get(shape) or self._batches.setdefault(shape, BatchKV(seqs, shape[0]))
        batch.seqs = seqs
        return batch
