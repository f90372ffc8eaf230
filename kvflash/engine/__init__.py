"""The GPU-side core: the chunk pool and host tier, sequences and their residency, paged and batched
KV, and the engine's forward step, prefill and decode (docs/ARCHITECTURE.md: Layout)."""
