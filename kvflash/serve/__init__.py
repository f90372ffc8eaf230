"""Turns over the engine: prompts, sessions, the prefix cache and snapshots, the scheduler, the
OpenAI-compatible server and its thin client (docs/ARCHITECTURE.md: Layout)."""
