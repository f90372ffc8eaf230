"""The options of every command that builds an Engine, declared once, and the one path from them to a
loaded model and an Engine.

A command takes them as one parameter, `engine: EngineOptions = ENGINE`, under `@engine_command()`:
the decorator puts each field's typer option where that parameter stands, so every such command
(ask, chat, serve, niah, bench) exposes the same flags with the same names and help, and the command
receives them as one `EngineOptions`. Nothing here imports torch until an engine is built, so a thin
command (`ask --server`) still loads none.
"""

from __future__ import annotations

import copy
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from kvflash import KVFlashError
from kvflash.cli.options import DeviceOpt, DtypeOpt, HostBytesOpt, KvDtypeOpt, ModelOpt
from kvflash.policies import POLICIES

if TYPE_CHECKING:
    from kvflash.config import EngineConfig
    from kvflash.engine.engine import Engine
    from kvflash.models.loader import LoadedModel

DEFAULT_POOL_TOKENS = 16384
"""The pool when --pool-tokens is left out: a budget any GPU (and a CPU) holds for the default model."""

PoolOpt = typer.Option(
    None, "--pool-tokens",
    help="KV budget in tokens (default: 16384; 'auto': free GPU memory, on a CPU half the free host memory).",
)  # fmt: skip
PolicyOpt = typer.Option("qk", "--policy", help=f"Residency policy: {', '.join(POLICIES)}.")
AbsolutePositionsOpt = typer.Option(
    False, "--absolute-positions", help="Attend at absolute positions, not positions within the cache."
)
CacheOrderOpt = typer.Option(
    "document", "--cache-order",
    help="Order of the resident chunks' positions within the cache: document, or score (the "
    "best-scoring chunk just before the recent ones, the first chunks placed by score too).",
)  # fmt: skip
ScoutReadsOpt = typer.Option(
    0, "--scout-reads", min=0,
    help="Chunks of a lazily restored document each scout of a question reads from the store to score "
    "them from their keys, the ones its summaries score highest (0: read only the chunks selected).",
)  # fmt: skip
StepTokensOpt = typer.Option(
    None, "--step-tokens", min=64,
    help="Most prompt tokens one forward computes, of one prompt or several (default: 32768 on CUDA, "
    "512 on a CPU).",
)  # fmt: skip
GraphsOpt = typer.Option(
    True, "--cuda-graphs/--no-cuda-graphs", help="Replay each decode step from a CUDA graph (on CUDA)."
)


@dataclass(frozen=True)
class EngineOptions:
    """The engine flags as given: None where one was left out, so the engine's own default applies."""

    model: Path | None = None
    dtype: str | None = None
    kv_dtype: str | None = None
    device: str | None = None
    pool_tokens: str | None = None
    """A number of tokens or 'auto', as typed (`parse_pool_tokens`)."""
    host_bytes: int | None = None
    policy: str = "qk"
    absolute_positions: bool = False
    cache_order: str = "document"
    scout_reads: int = 0
    step_tokens: int | None = None
    cuda_graphs: bool = True

    def pool(self, default: int | None = DEFAULT_POOL_TOKENS) -> int | str | None:
        """--pool-tokens as a number of tokens or 'auto'; `default` where it was left out."""
        return default if self.pool_tokens is None else parse_pool_tokens(self.pool_tokens)

    def config(self, pool_tokens: int | str | None = None) -> EngineConfig:
        """The EngineConfig these options give, with `pool_tokens` instead of --pool-tokens where a
        caller sizes the pool itself (niah, per trial)."""
        from kvflash.config import EngineConfig, ResidencyConfig

        res = ResidencyConfig(
            policy=self.policy,
            cache_positions=not self.absolute_positions,
            cache_order=self.cache_order,
            scout_reads=self.scout_reads,
        )
        given = {
            "host_bytes": self.host_bytes,
            "kv_dtype": self.kv_dtype,
            "prefill_step_tokens": self.step_tokens,
        }
        return EngineConfig(
            pool_tokens=self.pool() if pool_tokens is None else pool_tokens,
            residency=res,
            cuda_graphs=self.cuda_graphs,
            **{k: v for k, v in given.items() if v is not None},
        )


OPTIONS: dict[str, Any] = {
    "model": ModelOpt,
    "dtype": DtypeOpt,
    "kv_dtype": KvDtypeOpt,
    "device": DeviceOpt,
    "pool_tokens": PoolOpt,
    "host_bytes": HostBytesOpt,
    "policy": PolicyOpt,
    "absolute_positions": AbsolutePositionsOpt,
    "cache_order": CacheOrderOpt,
    "scout_reads": ScoutReadsOpt,
    "step_tokens": StepTokensOpt,
    "cuda_graphs": GraphsOpt,
}
"""Each EngineOptions field's typer option, in the order `--help` lists them."""

FLAGS = {
    name: next(d for d in opt.param_decls if d.startswith("--")).split("/")[0]
    for name, opt in OPTIONS.items()
}
"""Each field's flag, for messages that name one."""

ENGINE = EngineOptions()
"""The default of a command's `engine` parameter; `engine_command` replaces it by the flags."""


def parse_pool_tokens(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        raise KVFlashError(f"--pool-tokens takes a number of tokens or 'auto', not {value!r}") from None
    if n < 1:
        raise KVFlashError("--pool-tokens must be positive")
    return n


def engine_command(
    defaults: dict[str, object] | None = None, helps: dict[str, str] | None = None
) -> Callable[[Callable], Callable]:
    """A command function's `engine: EngineOptions` parameter as the OPTIONS, one typer parameter
    each, in its place; `defaults` and `helps` replace a field's default and help for this command
    (niah's policy is `full`, and its pool sized per trial unless given)."""
    defaults, helps = defaults or {}, helps or {}
    unknown = (defaults.keys() | helps.keys()) - OPTIONS.keys()
    if unknown:
        raise ValueError(f"not engine options: {', '.join(sorted(unknown))}")
    field_types = typing.get_type_hints(EngineOptions)

    def wrap(command: Callable) -> Callable:
        hints = typing.get_type_hints(command)
        params: list[inspect.Parameter] = []
        for p in inspect.signature(command).parameters.values():
            if p.name != "engine":
                params.append(p.replace(annotation=hints.get(p.name, p.annotation)))
                continue
            for name, opt in OPTIONS.items():
                opt = copy.copy(opt)
                if name in defaults:
                    opt.default = defaults[name]
                if name in helps:
                    opt.help = helps[name]
                params.append(inspect.Parameter(name, p.kind, default=opt, annotation=field_types[name]))
        if len(params) != len(inspect.signature(command).parameters) + len(OPTIONS) - 1:
            raise TypeError(f"{command.__name__} takes no `engine` parameter")

        def run(*args, **kwargs):
            engine = EngineOptions(**{name: kwargs.pop(name) for name in OPTIONS if name in kwargs})
            return command(*args, engine=engine, **kwargs)

        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            setattr(run, attr, getattr(command, attr))
        run.__signature__ = inspect.Signature(params, return_annotation=None)
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return wrap


def load_with_progress(model: Path | None, dtype: str | None, device: str | None) -> LoadedModel:
    """load_model with a progress bar on stderr over the GGUF's tensor bytes (gone once loaded)."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from kvflash.models.loader import load_model

    with Progress(
        TextColumn("load model"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
        console=Console(stderr=True), transient=True, redirect_stdout=False, redirect_stderr=False,
    ) as bar:  # fmt: skip
        task = bar.add_task("load", total=None)
        return load_model(model, dtype=dtype, device=device, on_progress=lambda done, total: bar.update(
            task, completed=done, total=total))  # fmt: skip


def load_model(opts: EngineOptions, cfg: EngineConfig | None = None, *, progress: bool = True) -> LoadedModel:
    """The model the options name, and, given the EngineConfig it will run under, its pool checked
    against the device's free memory, so a pool too large is refused in one line before anything
    that size is allocated (`limits.check_pool_fits`). `progress`: a progress bar on stderr."""
    from kvflash.cli.limits import check_pool_fits
    from kvflash.models import loader

    if progress:
        lm = load_with_progress(opts.model, opts.dtype, opts.device)
    else:
        lm = loader.load_model(opts.model, dtype=opts.dtype, device=opts.device)
    if cfg is not None:
        check_pool_fits(lm, cfg.pool_tokens, cfg.residency.chunk_tokens, cfg.kv_dtype)
    return lm


def open_engine(
    opts: EngineOptions, *, warm: bool = True, progress: bool = True
) -> tuple[LoadedModel, Engine]:
    """The loaded model and an Engine over it, as the options say. Flags are checked before the model
    loads, the pool's size once it has (`load_model`). `warm`: as `Engine`'s."""
    from kvflash.engine.engine import Engine

    cfg = opts.config()
    lm = load_model(opts, cfg, progress=progress)
    return lm, Engine(lm, cfg, warm=warm)
