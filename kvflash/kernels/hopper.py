"""The kernels as an H200 would compile them, on a machine without one.

The interpreter runs the kernels' fp32 branches, so a constraint of the GPU's own (an e4m3 dot needs
32 keys along K) meets nothing on a CPU; and what a loop compiles to (bench/kernel_sass.py) depends
on every value a launch specialises on. Here a launcher's launches are recorded instead of run,
with the launchers deciding as on an H200 (`launches_as_on_hopper`), and a recorded launch is
compiled for sm_90 through Triton's own binder (`compile_for_hopper`), so that it is specialised
as that launch would be (each argument's type, divisibility by 16, integers of 1 as constants).
The binder and `JITFunction._pack_args` are Triton's internals (3.6 and 3.9 have them alike): a
Triton that changes them fails here loudly, not silently.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from kvflash.kernels import triton_copy, triton_decode, triton_prefill, triton_scoring

HOPPER = GPUTarget("cuda", 90, 32)
H200_FACTS = {
    "f32_dot": lambda t: False,
    "sm_count": lambda device: 132,
    "use_pdl": lambda head_dim, device: head_dim < 128,
}
"""What the launchers ask of the device, answered as on an H200: dots on the kernels' GPU path (not
the interpreter's fp32 one), 132 SMs, programmatic dependent launch where head_dim is 64."""

Launch = tuple[JITFunction, tuple, dict]
"""A recorded launch: the kernel, its positional arguments and its keywords (constexprs, options)."""


@contextlib.contextmanager
def launches_as_on_hopper() -> Iterator[list[Launch]]:
    """Kernel launches recorded instead of run (into the yielded list), by launchers that decide
    as on an H200."""
    launches: list[Launch] = []
    with contextlib.ExitStack() as stack:
        record = lambda self, *args, grid, warmup, **kw: launches.append((self, args, kw))  # noqa: E731
        stack.enter_context(mock.patch.object(JITFunction, "run", record))
        for module in (triton_decode, triton_prefill, triton_scoring, triton_copy):
            for name in H200_FACTS.keys() & vars(module).keys():
                stack.enter_context(mock.patch.object(module, name, H200_FACTS[name]))
        yield launches


def compile_for_hopper(launch: Launch):
    """One recorded launch compiled for sm_90, specialised as the launch itself would be, with
    floating-point fusion on, as Triton has compiled by default through 3.9 (the GPU machine's 3.6)."""
    fn, backend, kw, (bound, specialization, options) = _bind(launch)
    options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, specialization, options)
    source = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(source, target=HOPPER, options=options.__dict__)


def variant_of(launch: Launch) -> str:
    """The kernel variant a recorded launch runs on an H200: the kernel, what the JIT specialises
    each argument on (its type, a pointer's alignment, an integer's divisibility by 16 or being 1,
    constexpr values) and the launch options. A launch whose variant no earlier launch had compiles
    (or loads from the cache) first."""
    fn, _, _, (_, specialization, options) = _bind(launch)
    return repr((fn.fn.__qualname__, specialization, options))


def _bind(launch: Launch):
    fn, args, kw = launch
    kw = {"enable_fp_fusion": True, **kw}
    backend = make_backend(HOPPER)
    bind = create_function_from_signature(fn.signature, fn.params, backend)
    return fn, backend, kw, bind(*args, **kw)
