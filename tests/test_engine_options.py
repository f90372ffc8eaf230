"""Every command that builds an engine takes the same engine options, declared once
(kvflash/cli/engine_options.py), and hands them to the engine it builds."""

from __future__ import annotations

import dataclasses
import re

import pytest
from typer.testing import CliRunner

from kvflash import KVFlashError
from kvflash.cli.app import _LazyCommands, app
from kvflash.cli.engine_options import FLAGS, OPTIONS, EngineOptions

ENGINE_COMMANDS = ("ask", "chat", "serve", "niah", "bench")


def flags(command: str) -> set[str]:
    cmd = _LazyCommands()[command]
    return {decl.split("/")[0] for p in cmd.params for decl in p.opts if decl.startswith("--")}


def help_flags(command: str) -> set[str]:
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "240"})
    assert result.exit_code == 0, result.output
    return set(re.findall(r"(--[a-z][a-z-]+)", result.output))


def test_every_engine_command_takes_the_same_engine_options() -> None:
    engine = set(FLAGS.values())
    assert engine == {
        "--model", "--dtype", "--kv-dtype", "--device", "--pool-tokens", "--host-bytes", "--policy",
        "--absolute-positions", "--cache-order", "--scout-reads", "--step-tokens", "--cuda-graphs",
    }  # fmt: skip
    assert list(OPTIONS) == [f.name for f in dataclasses.fields(EngineOptions)]
    for command in ENGINE_COMMANDS:
        assert engine <= flags(command), (command, engine - flags(command))
        assert engine <= help_flags(command), (command, engine - help_flags(command))


def test_a_command_receives_its_flags_as_one_engine_options(monkeypatch) -> None:
    """bench's flags reach the EngineConfig each of its turns builds; niah keeps its own defaults."""
    seen = {}

    def stop(opts: EngineOptions, cfg, progress: bool = True):
        seen["opts"], seen["cfg"] = opts, cfg
        raise KVFlashError("stop before loading")

    monkeypatch.setattr("kvflash.cli.bench_cmd.load_model", stop)
    args = ["bench", "--lengths", "1K", "--out", "/tmp/kvflash-never", "--pool-tokens", "512",
            "--host-bytes", "4096", "--policy", "lru", "--absolute-positions", "--no-cuda-graphs",
            "--kv-dtype", "fp16", "--device", "cpu", "--dtype", "fp32", "--step-tokens", "256",
            "--scout-reads", "8"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert str(result.exception) == "stop before loading"
    assert seen["opts"] == EngineOptions(
        dtype="fp32", kv_dtype="fp16", device="cpu", pool_tokens="512", host_bytes=4096, policy="lru",
        absolute_positions=True, step_tokens=256, cuda_graphs=False, scout_reads=8,
    )  # fmt: skip
    cfg = seen["cfg"]
    assert (cfg.pool_tokens, cfg.host_bytes, cfg.kv_dtype, cfg.cuda_graphs) == (512, 4096, "fp16", False)
    assert cfg.prefill_step_tokens == 256
    assert cfg.residency.policy == "lru" and not cfg.residency.cache_positions
    assert cfg.residency.scout_reads == 8


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bench", "--policy", "nope"], "unknown policy"),
        (["serve", "--pool-tokens", "lots"], "--pool-tokens takes"),
        (["bench", "--cache-order", "nope"], "unknown cache order"),
        (["bench", "--absolute-positions", "--cache-order", "score"], "needs positions within the cache"),
        (["niah", "--policy", "qk", "--pool-tokens", "auto"], "number of tokens"),
    ],
)
def test_bad_engine_flags_fail_before_loading_a_model(tmp_path, args: list[str], message: str) -> None:
    flags = ["--model", "/nowhere.gguf"] + (["--out", str(tmp_path / "o")] if args[0] != "serve" else [])
    result = CliRunner().invoke(app, [*args, *flags])
    assert isinstance(result.exception, KVFlashError) and re.search(message, str(result.exception))


def test_niah_keeps_its_own_policy_default() -> None:
    (policy,) = [p for p in _LazyCommands()["niah"].params if p.name == "policy"]
    (other,) = [p for p in _LazyCommands()["ask"].params if p.name == "policy"]
    assert (policy.default, other.default) == ("full", "qk")
