"""Evaluation: needle-in-a-haystack material and grids, and `kvflash bench`'s cold and restored
sessions (docs/ARCHITECTURE.md: Layout)."""
