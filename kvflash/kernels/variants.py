"""Counts the Triton kernel variants this process builds: compiled, or loaded from Triton's cache on
disk, each the first time a launch meets a specialisation (its constexprs, launch options and the
alignment of its pointers) that the process has not launched before.

After the engine's warm-up a serving process should build none: a variant built then stalls the step
that needs it, and every request in it, for a whole compile. The count (`built`, /metrics'
`kvflash_kernel_variants_built_total`) shows a deployment when that happens; tests hold the engine
to it. Counting hooks Triton's JIT cache (`triton.knobs.runtime.jit_cache_hook`, called before
each build), after any hook already there."""

from __future__ import annotations

import threading

_lock = threading.Lock()
_built = 0
_installed = False


def install() -> None:
    """Starts counting (once a process; where Triton has no JIT cache hook, nothing is counted)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    import triton

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        return
    before = runtime.jit_cache_hook

    def counted(*args, **kwargs):
        global _built
        with _lock:
            _built += 1
        return before(*args, **kwargs) if before is not None else None

    runtime.jit_cache_hook = counted


def built() -> int:
    """Kernel variants built since `install`."""
    return _built
