"""What the decode and prefill kernels' main loops compile to on Hopper, without a GPU: their
instructions and the bytes they move through shared memory, per 64-token tile.

Decode attention is bound by memory, or by whatever stands between memory and the tensor cores:
instruction issue, or shared memory, which each tile crosses at least once (copied in by cp.async)
and again each time a dot reads it (an fp8 tile widened to fp16 through shared memory crossed it
four times). This records the launch `paged_decode_attention` makes for a batch of BATCH sequences
(`--batch`: the launch rules change with it, an fp8 program of head_dim 128 serving two kv-heads
from batch 32) of CONTEXT tokens (fused merge, unrotated keys), or the one `prefill_attention` makes
for a step of PREFILL_QUERIES queries after PREFILL_CONTEXT tokens (`--kernels prefill`, its own
warps and stages), and compiles it for sm_90 with the installed Triton as that launch would be
specialised (`kvflash.kernels.hopper`: pointers and strides divisible by 16, without which the
compiler vectorises and pipelines nothing), disassembles the cubin with the nvdisasm Triton bundles,
finds the loop over blocks (the largest backward branch around the tensor-core instructions) and
counts, per warp and tile: all instructions, those by family, and shared-memory bytes by instruction
(cp.async writes, loads, stores, ldmatrix), which over the tile's KV bytes is the shared traffic a
byte of KV costs. Shared memory serves 128 B a clock an SM; HBM about 16-20 B a clock an SM, so past
~6 bytes of shared traffic a KV byte, shared memory, not HBM, bounds a tile.

The counts are the installed Triton's: the GPU machine's may differ (the JSON names the version).

    python -m bench.kernel_sass --out out/kernel_sass
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
from rich.console import Console
from rich.table import Table

from bench.harness import out_dir, pyplot, save_png, write_json
from kvflash.kernels import triton_decode, triton_prefill
from kvflash.kernels._common import FP8
from kvflash.kernels.hopper import Launch, compile_for_hopper, launches_as_on_hopper

CHUNK = 64
"""Tokens a chunk, and a tile (one chunk a block: the engine's default)."""
BATCH = 16
CONTEXT = 65536
PREFILL_QUERIES = 512
PREFILL_CONTEXT = 12288
SHAPES = {"SmolLM2": (64, 3, 3), "Llama-8B": (128, 4, 8)}
"""model -> (head_dim, query heads a kv-head, kv-heads)."""
FAMILIES = {
    "tensor core": ("HMMA", "HGMMA", "QGMMA"),
    "shared memory": ("LDS", "STS", "LDSM", "STSM", "LDGSTS"),
    "global": ("LDG", "STG"),
    "convert": ("F2FP", "I2F", "F2I"),
    "float": ("FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "MUFU", "HADD2", "HFMA2"),
    "move": ("MOV", "IMAD.MOV", "PRMT", "SHFL"),
    "sync": ("BAR", "DEPBAR", "LDGDEPBAR", "WARPGROUP"),
}
"""Instruction families, by opcode prefix (first match wins, in this order)."""


@dataclass
class Loop:
    kernel: str
    """decode or prefill."""
    model: str
    kv: str
    warps: int
    stages: int
    heads: int
    """kv-heads a program (`triton_decode.decode_heads`): a tile holds their 64 tokens each."""
    registers: int
    shared_bytes: int
    """Shared memory the kernel allocates."""
    programs_per_sm: int
    """Programs an SM holds at once, as its registers and shared memory allow (`resident`)."""
    spills: int
    """Local-memory loads and stores in the loop (registers spilled), per warp and tile."""
    instructions: int
    """In the loop, per warp and tile."""
    instructions_per_kib: float
    """Per warp, a KiB of the tile's KV: what compares programs of different kv-heads."""
    families: dict[str, int]
    shared_traffic: dict[str, int]
    """Bytes through shared memory per tile (all warps), by instruction."""
    traffic_per_kv_byte: float


def _pool(model: str, kv: str) -> torch.Tensor:
    """Two slots of two layers in the engine's layout (fp8: a scale row a block)."""
    d, _, h_kv = SHAPES[model]
    fp8 = kv == "fp8"
    return torch.zeros(2, 2, 2, h_kv, CHUNK + fp8, d, dtype=FP8 if fp8 else torch.bfloat16)


def decode_loop(
    model: str,
    kv: str,
    warps: int,
    stages: int,
    stack: bool,
    max_registers: int | None = None,
    batch: int = BATCH,
) -> tuple[Loop, list[str]]:
    """The decode launcher's own launch at this shape, 64-token tiles, these warps and stages;
    `stack` lets the program serve the kv-heads `decode_heads` gives it (else one);
    `max_registers` caps the registers a thread (the launch's maxnreg)."""
    d, group, h_kv = SHAPES[model]
    q = torch.zeros(batch, h_kv * group, d, dtype=torch.bfloat16)
    table = torch.zeros(batch, CONTEXT // CHUNK, dtype=torch.int32)
    listed = torch.full((batch,), CONTEXT // CHUNK, dtype=torch.int32)
    with launches_as_on_hopper() as launches:
        triton_decode.paged_decode_attention(
            q, _pool(model, kv), 1, table, listed, listed, d**-0.5, fused=True, block_tokens=CHUNK,
            num_warps=warps, num_stages=stages, heads=None if stack else 1, max_registers=max_registers,
        )  # fmt: skip
    return measure("decode", model, kv, launches[0])


def prefill_loop(model: str, kv: str) -> tuple[Loop, list[str]]:
    """The prefill launcher's own launch for a step of PREFILL_QUERIES queries after PREFILL_CONTEXT
    tokens, with the warps, stages and query tile it picks."""
    d, group, h_kv = SHAPES[model]
    n = (PREFILL_CONTEXT + PREFILL_QUERIES) // CHUNK
    q = torch.zeros(PREFILL_QUERIES, h_kv * group, d, dtype=torch.bfloat16)
    slots, order = torch.zeros(n, dtype=torch.int32), torch.arange(n, dtype=torch.int32)
    with launches_as_on_hopper() as launches:
        triton_prefill.prefill_attention(q, _pool(model, kv), 1, slots, order, PREFILL_CONTEXT, d**-0.5)
    return measure("prefill", model, kv, launches[0])


def measure(kernel_name: str, model: str, kv: str, launch: Launch) -> tuple[Loop, list[str]]:
    """A recorded launch compiled for sm_90 (`compile_for_hopper`) and its loop counted."""
    d = SHAPES[model][0]
    heads = launch[2].get("HEADS", 1)
    kernel = compile_for_hopper(launch)
    warps, stages = kernel.metadata.num_warps, kernel.metadata.num_stages
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([tools / "nvdisasm", "-c", cubin], capture_output=True, text=True, check=True)
        usage = subprocess.run([tools / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True)
    loop = _loop(sass.stdout)
    tile_kv = 2 * CHUNK * d * heads * (1 if kv == "fp8" else 2)
    traffic = _shared_traffic(loop, warps)
    regs = int(m.group(1)) if (m := re.search(r"REG:(\d+)", usage.stdout)) else -1
    spills = sum(_opcode(ln).startswith(("LDL", "STL")) for ln in loop)
    return Loop(kernel_name, model, kv, warps, stages, heads, regs, kernel.metadata.shared,
                resident(regs, kernel.metadata.shared, warps), spills, len(loop), len(loop) * 1024 / tile_kv,
                _families(loop), traffic, sum(traffic.values()) / tile_kv), loop  # fmt: skip


SM_REGISTERS = 65536
SM_SHARED = 233472
"""An sm_90 SM's register file (32-bit registers) and shared memory (228 KiB, of which each resident
program also takes 1 KiB for the system)."""


def resident(registers: int, shared: int, warps: int) -> int:
    """Programs of this kernel an sm_90 SM holds at once: registers are allocated a warp at a time
    in units of 256, at most 32 programs and 64 warps an SM."""
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = SM_REGISTERS // (per_warp * warps) if registers > 0 else 32
    return min(by_regs, SM_SHARED // (shared + 1024), 32, 64 // warps)


_ADDR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/")
_OP = re.compile(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def _loop(sass: str) -> list[str]:
    """The instructions of the largest loop that holds tensor-core instructions."""
    lines = [ln for ln in sass.splitlines() if _ADDR.match(ln)]
    where = {ln: int(_ADDR.match(ln).group(1), 16) for ln in lines}
    labels = {}
    text = sass.splitlines()
    for i, ln in enumerate(text):
        if m := re.match(r"(\.L_x_\d+):", ln.strip()):
            nxt = next((t for t in text[i + 1 : i + 4] if _ADDR.match(t)), None)
            if nxt is not None:
                labels[m.group(1)] = int(_ADDR.match(nxt).group(1), 16)
    best: list[str] = []
    for ln in lines:
        m = re.search(r"BRA `?\(?(\.L_x_\d+)", ln)
        if m and labels.get(m.group(1), 1 << 62) < where[ln]:
            body = [t for t in lines if labels[m.group(1)] <= where[t] <= where[ln]]
            if len(body) > len(best) and any(re.search(r"[HQ]?G?MMA", t) for t in body):
                best = body
    return best


def _opcode(line: str) -> str:
    m = _OP.search(line)
    return m.group(1) if m else ""


def _families(loop: list[str]) -> dict[str, int]:
    counts: collections.Counter[str] = collections.Counter()
    for ln in loop:
        op = _opcode(ln)
        fam = next((f for f, prefixes in FAMILIES.items() if op.startswith(prefixes)), "integer, other")
        counts[fam] += 1
    return dict(counts)


def _shared_traffic(loop: list[str], warps: int) -> dict[str, int]:
    """Bytes a tile moves through shared memory (all warps): each instruction's width times its 32
    lanes (ldmatrix: 128 B a matrix; predicated-off `@!PT` loads, which move nothing, left out)."""
    out: collections.Counter[str] = collections.Counter()
    for ln in loop:
        if "@!PT" in ln:
            continue
        op = _opcode(ln)
        base = op.split(".")[0]
        if base in ("LDSM", "STSM"):
            count = re.search(r"\.(\d)\b", op[len(base) :])
            out[base] += 128 * (int(count.group(1)) if count else 1) * warps
        elif base in ("LDS", "STS", "LDGSTS"):
            bits = re.search(r"\.(128|64|32|U8|S8|U16|S16)\b", op)
            width = (
                {"128": 16, "64": 8, "32": 4, "U8": 1, "S8": 1, "U16": 2, "S16": 2}[bits.group(1)]
                if bits
                else 4
            )
            out[base] += 32 * width * warps
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", nargs="+", choices=["decode", "prefill"], default=["decode"])
    ap.add_argument("--models", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--kv", nargs="+", choices=["bf16", "fp8"], default=["bf16", "fp8"])
    ap.add_argument("--warps", nargs="+", type=int, default=[2, 4], help="decode's (prefill: its own)")
    ap.add_argument("--stages", type=int, default=2, help="decode's (prefill: its own)")
    ap.add_argument("--batch", type=int, default=BATCH, help="decode's sequences (prefill: one)")
    ap.add_argument(
        "--stack", nargs="+", choices=["rule", "one"], default=["rule"],
        help="kv-heads a program: the launcher's (decode_heads), or one",
    )  # fmt: skip
    ap.add_argument(
        "--max-registers", type=int, nargs="+", default=[0],
        help="decode: cap the registers a thread (maxnreg) at each of these (0: uncapped)",
    )  # fmt: skip
    ap.add_argument("--dump", action="store_true", help="also write each loop's SASS")
    ap.add_argument("--out", default="out/kernel_sass")
    args = ap.parse_args()
    out = out_dir(args.out)
    rows = []
    measured = []
    for model in args.models:
        for kv in args.kv:
            if "decode" in args.kernels:
                for warps in args.warps:
                    for stack in [s for s in ("rule", "one") if s in args.stack]:
                        if stack == "one" and "rule" in args.stack and measured[-1][0].heads == 1:
                            continue  # the rule's row serves one kv-head already
                        for regs in args.max_registers:
                            loop = decode_loop(
                                model, kv, warps, args.stages, stack == "rule", regs or None, args.batch
                            )
                            measured.append(loop)
            if "prefill" in args.kernels:
                measured.append(prefill_loop(model, kv))
    rows = [loop for loop, _ in measured]
    if args.dump:
        for r, sass in measured:
            name = f"{r.kernel}-{r.model}-{r.kv}-{r.warps}w-{r.heads}h-{r.registers}r.sass"
            (out / name).write_text("\n".join(sass))
    table = Table(title=f"main loops per 64-token tile, sm_90, Triton {triton.__version__}")
    for col in ("kernel", "model", "KV", "warps", "kv-heads", "regs", "programs an SM", "spills a tile",
                "instructions a warp", "a KV KiB", "shared bytes a tile", "a KV byte"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r.kernel, r.model, r.kv, str(r.warps), str(r.heads), str(r.registers),
                      str(r.programs_per_sm), str(r.spills), str(r.instructions),
                      f"{r.instructions_per_kib:.0f}", f"{sum(r.shared_traffic.values()):,}",
                      f"{r.traffic_per_kv_byte:.1f}")  # fmt: skip
    Console().print(table)
    meta = {
        "triton": triton.__version__,
        "target": "sm_90",
        "decode_stages": args.stages,
        "decode_batch": args.batch,
    }
    write_json(out / "kernel_sass.json", {"meta": meta, "rows": [asdict(r) for r in rows]})
    plot(rows, out / "kernel_sass.png")


def plot(rows: list[Loop], path: Path) -> None:
    """Shared-memory bytes per KV byte, one bar per configuration, split by instruction."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(1.2 * len(rows) + 2, 3.8))
    kinds = sorted({k for r in rows for k in r.shared_traffic})
    bottom = [0.0] * len(rows)
    for kind in kinds:
        share = [r.shared_traffic.get(kind, 0) / (r.shared_traffic and sum(r.shared_traffic.values()) or 1)
                 * r.traffic_per_kv_byte for r in rows]  # fmt: skip
        ax.bar(range(len(rows)), share, bottom=bottom, label=kind)
        bottom = [b + s for b, s in zip(bottom, share, strict=True)]
    ax.set_xticks(
        range(len(rows)), [f"{r.kernel} {r.model}\n{r.kv} {r.warps}w {r.heads}h {r.registers}r" for r in rows]
    )
    ax.set_ylabel("shared-memory bytes a KV byte")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


if __name__ == "__main__":
    main()
