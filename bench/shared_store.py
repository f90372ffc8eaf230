"""Turn 2 of a conversation on another server: restored from the shared Redis tier, against a cold
prefill and against a restore from the local disk, on one machine with one redis-server.

Turn 1 (document + question) runs on server A (`--store A --shared-store URL`), which copies its
snapshot to Redis in the background. Turn 2 then runs on server B (`--store B --shared-store URL`,
B's disk empty): it restores from Redis. The same turn 2 is then asked of a server whose disk holds
A's store (`--store copy-of-A`, no Redis), and of one with `--no-store` (cold). Client TTFT of each,
and the bytes Redis sent while B restored (INFO total_net_output_bytes). Then, in this process, the
snapshot's chunks are restored from Redis into CPU tensors and, in the same run, raw GETs of the
same keys: the restore's throughput against the raw GET's.

Targets: turn 2 from Redis <= 1.5 x turn 2 from local disk and <= 1/5 of cold on a 32K-token
document; restore >= 70 % of raw GET.

`--random-model` serves random weights whose KV has the default model's shape (layers, kv-heads,
head dim) with one query head per kv-head, a narrow residual stream and a byte-level vocabulary:
restores move the same bytes as the default model's, and a cold prefill of 32K tokens costs what a
2-core machine can afford.

  python -m bench.shared_store --doc-tokens 32768 --out out/shared_store
  python -m bench.shared_store --doc-tokens 32768 --random-model --out out/shared_store_random
"""

from __future__ import annotations

import argparse
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from bench.harness import progress_bar, pyplot, save_png, write_json
from bench.serve import QUESTIONS, Served, prepare
from tests.redis_util import RedisServer

COPY_WAIT_S = 1800
"""A 32K-token snapshot is over a GB of chunks to copy on shared cores."""


def wait_for_copy(url: str, timeout_s: float = COPY_WAIT_S) -> None:
    """Until A's write-back has put a snapshot in Redis."""
    from kvflash.storage.redis_store import RedisStore

    with RedisStore(url) as st:
        deadline = time.monotonic() + timeout_s
        while not st.list_snapshots():
            if time.monotonic() > deadline:
                raise SystemExit("the snapshot never reached Redis")
            time.sleep(0.5)


def random_model(path: Path) -> str:
    """A random-weight GGUF with the default model's KV shape, at `path`."""
    from kvflash.models.loader import load_model
    from tests.gguf_util import TinySpec, write_tiny_gguf

    cfg = load_model(None, device="cpu", need_tokenizer=False).config
    hkv, d = cfg.n_kv_heads, cfg.head_dim
    spec = TinySpec(
        n_layers=cfg.n_layers, hidden=hkv * d, n_heads=hkv, n_kv_heads=hkv, head_dim=d, ffn=256, tie=True,
        context=1 << 17,
    )  # fmt: skip
    write_tiny_gguf(path, spec)
    return str(path)


def sent_bytes(redis: RedisServer) -> int:
    return int(redis.client().info("stats")["total_net_output_bytes"])


def restore_vs_get(url: str, rounds: int = 3) -> dict:
    """The snapshot's chunks restored from Redis into CPU tensors (every check, as a server's
    restore), and raw GETs of the same blobs on one connection, best of `rounds` each."""
    from kvflash.storage.redis_store import RedisStore

    with RedisStore(url) as st:
        snap = st.get_snapshot(max(st.list_snapshots(), key=lambda s: s.n_chunks).id)
        hashes = list(snap.chunk_hashes)
        head = st.read_header(hashes[0])
        outs = [torch.empty(head.shape, dtype=head.dtype) for _ in hashes]
        keys = [st.backend.keys.blob(h) for h in hashes]
        client = st.link.client
        restore_s, get_s = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            st.read_chunks_parallel(hashes, snap.fingerprint, head.shape, head.dtype, outs)
            restore_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            nbytes = sum(len(client.get(k)) for k in keys)
            get_s.append(time.perf_counter() - t0)
    return {
        "chunks": len(hashes),
        "stored_bytes": nbytes,
        "restore_s": min(restore_s),
        "get_s": min(get_s),
        "restore_mb_s": nbytes / min(restore_s) / 1e6,
        "get_mb_s": nbytes / min(get_s) / 1e6,
        "ratio": min(get_s) / min(restore_s),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc-tokens", type=int, default=32768)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--pool-tokens", type=int, default=40960)
    ap.add_argument("--max-prompt-tokens", type=int, default=40960, help="beyond the model's own context")
    ap.add_argument("--model", default=None)
    ap.add_argument(
        "--random-model", action="store_true", help="random weights of the default model's KV shape"
    )
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default="out/shared_store")
    args = ap.parse_args()
    if args.random_model:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        args.model = random_model(Path(args.out) / "random.gguf")
    out, doc = prepare(args)
    turn1 = [{"role": "system", "content": doc}, {"role": "user", "content": QUESTIONS[0]}]
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp, progress_bar() as progress:
        tmp = Path(tmp)
        task = progress.add_task("turns", total=5)
        redis = RedisServer(tmp / "redis").start()
        try:
            a = Served(args, tmp / "a", shared=redis.url)
            try:
                rows["turn 1 on A (cold)"] = a.turn(turn1, args.max_tokens)
            finally:
                a.stop(COPY_WAIT_S)  # closing waits for the copy to Redis
            progress.advance(task)
            wait_for_copy(redis.url)
            turn2 = [*turn1, {"role": "assistant", "content": rows["turn 1 on A (cold)"]["text"]}]
            turn2.append({"role": "user", "content": QUESTIONS[1]})
            shutil.copytree(tmp / "a", tmp / "disk")
            b = Served(args, tmp / "b", shared=redis.url)
            try:
                before = sent_bytes(redis)
                rows["turn 2 on B from Redis"] = b.turn(turn2, args.max_tokens)
                rows["turn 2 on B from Redis"]["redis_sent_bytes"] = sent_bytes(redis) - before
            finally:
                b.stop(COPY_WAIT_S)  # and for its read-through and its own snapshot's copy
            progress.advance(task)
            for name, store in (("turn 2 on B from local disk", tmp / "disk"), ("turn 2 on B cold", None)):
                s = Served(args, store)
                try:
                    rows[name] = s.turn(turn2, args.max_tokens)
                finally:
                    s.stop()
                progress.advance(task)
            throughput = restore_vs_get(redis.url)
            progress.advance(task)
        finally:
            redis.stop()
    report(args, rows, throughput, out)


def report(args, rows: dict[str, dict], tp: dict, out: Path) -> None:
    redis_s = rows["turn 2 on B from Redis"]["ttft_s"]
    disk_s = rows["turn 2 on B from local disk"]["ttft_s"]
    cold_s = rows["turn 2 on B cold"]["ttft_s"]
    t = Table(title=f"turn 2 on another server, {args.doc_tokens:,}-token document: client TTFT")
    for col in ("run", "TTFT s", "cached tokens", "prompt tokens", "answer = cold"):
        t.add_column(col, justify="right")
    for name, r in rows.items():
        same = r["text"] == rows["turn 2 on B cold"]["text"] if "turn 2" in name else "-"
        t.add_row(name, f"{r['ttft_s']:.2f}", f"{r['cached_tokens']:,}", f"{r['prompt_tokens']:,}", str(same))
    Console().print(t)
    sent = rows["turn 2 on B from Redis"]["redis_sent_bytes"]
    Console().print(
        f"Redis / disk {redis_s / disk_s:.2f}x (target <= 1.5), Redis / cold {redis_s / cold_s:.3f} "
        f"(target <= 0.2); Redis sent {sent / 2**20:.1f} MiB for the restore\n"
        f"restore from Redis {tp['restore_mb_s']:.0f} MB/s vs raw GET {tp['get_mb_s']:.0f} MB/s of "
        f"{tp['stored_bytes'] / 2**20:.1f} MiB in {tp['chunks']} chunks: {tp['ratio']:.0%} (target >= 70 %)"
    )
    meta = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(), "args": vars(args)}
    body = {"meta": meta, "turns": rows, "throughput": tp}
    write_json(out / "shared_store.json", body)
    plot(rows, out / "shared_store.png")


def plot(rows: dict[str, dict], path: Path) -> None:
    plt = pyplot()

    names = [n for n in rows if n.startswith("turn 2")]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([n.removeprefix("turn 2 on B ") for n in names], [rows[n]["ttft_s"] for n in names])
    ax.set_yscale("log")
    ax.set_ylabel("turn 2 client TTFT (s)")
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
