"""Turn-2 vs turn-1 time to first token over long documents: `kvflash bench`'s measurement
(kvflash/eval/bench.py) over one or both position schemes side by side, the model loaded once.

Turn 1 prefills the document cold and snapshots it; turn 2 asks again in a fresh engine and session
and restores the document from disk (lazily when its KV exceeds the pool budget). Prints one table
per arm and writes JSON (and a PNG bar chart per arm) to --out.

  python -m bench.sessions --lengths 4096,8192 --pool-tokens 8192 --out out/sessions
"""

from __future__ import annotations

import argparse
import dataclasses

from rich.console import Console

from bench.harness import out_dir, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="4096,8192", help="token counts, 4K = 4096")
    ap.add_argument("--pool-tokens", default="8192")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default="out/sessions")
    ap.add_argument(
        "--positions", default="cache", help="cache, absolute, or both as cache,absolute: arms per length"
    )
    args = ap.parse_args()
    arms = args.positions.split(",")
    if not arms or any(a not in ("cache", "absolute") for a in arms):
        raise SystemExit(f"--positions takes cache, absolute or cache,absolute, not {args.positions!r}")
    out = out_dir(args.out)

    from kvflash.cli.engine_options import EngineOptions, load_model
    from kvflash.cli.niah_cmd import parse_lengths
    from kvflash.eval.bench import BenchConfig, plot, run, table

    opts = EngineOptions(model=args.model, device=args.device, pool_tokens=args.pool_tokens)
    lm = load_model(opts, opts.config())
    rows = []
    for arm in arms:
        engine = dataclasses.replace(opts, absolute_positions=arm == "absolute").config()
        cfg = BenchConfig(parse_lengths(args.lengths), engine, args.max_tokens, args.seed)
        arm_rows = [{**r, "positions": arm} for r in run(lm, cfg)]
        Console().print(table(arm_rows, f"{lm.device.type}, {arm} positions"))
        plot(arm_rows, out / f"sessions-{arm}.png", f"{lm.device.type}, {arm} positions")
        rows += arm_rows
    write_json(out / "sessions.json", {"device": lm.device.type, "model": str(lm.path), "rows": rows})


if __name__ == "__main__":
    main()
