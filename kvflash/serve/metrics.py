"""What `GET /metrics` reports: a server's counters and the engine's occupancy, in Prometheus's text
exposition format (written here: a few lines of text need no client library)."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from kvflash.serve.turn import TurnStats

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Upper bounds (seconds) of the time-to-first-token histogram."""


@dataclass
class ServerMetrics:
    """Counters a server adds to as requests end; read by `render` on another thread."""

    requests: Counter = field(default_factory=Counter)
    """Ended requests by outcome: the finish reason ("stop", "length"), "error", "refused" (a bad
    request) or "busy" (the waiting queue was full)."""
    tokens: Counter = field(default_factory=Counter)
    """Prompt tokens by where their KV came from ("cold" prefilled; "memory", the request's own live
    sequence; "gpu" and "host", chunks that other live sequences hold, shared from the pool or the
    host tier; "disk" and "lazy", the store), and "generated"."""
    pinned_chunks: int = 0
    """Chunks that answered requests pinned (`kvflash.pin`), summed over the requests."""
    ttft: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BUCKETS) + 1))
    ttft_sum: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def answered(self, finish: str, stats: TurnStats) -> None:
        with self._lock:
            self.requests[finish] += 1
            self.tokens["cold"] += stats.prefilled_tokens
            if stats.source == "shared":
                self.tokens["gpu"] += stats.restored_tokens - stats.shared_host_tokens
                self.tokens["host"] += stats.shared_host_tokens
            elif stats.restored_tokens:
                self.tokens[stats.source] += stats.restored_tokens
            self.tokens["generated"] += stats.generated_tokens
            self.pinned_chunks += stats.pinned_chunks
            self.ttft[sum(stats.ttft_s > b for b in TTFT_BUCKETS)] += 1
            self.ttft_sum += stats.ttft_s

    def failed(self, outcome: str = "error") -> None:
        """A request that failed in the engine ("error"), or that was refused before it ("refused",
        "busy")."""
        with self._lock:
            self.requests[outcome] += 1

    def render(self, readings: dict[str, tuple[str, str, float]]) -> str:
        """The exposition text: these counters, then `readings` (name -> (type, help, value)) taken
        now from the engine and the scheduler."""
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.extend((f"# HELP kvflash_{name} {help_}", f"# TYPE kvflash_{name} {kind}"))
            out.extend(f"kvflash_{name}{labels} {value:g}" for labels, value in samples)

        with self._lock:
            requests, tokens = dict(self.requests), dict(self.tokens)
            ttft, ttft_sum, pinned = list(self.ttft), self.ttft_sum, self.pinned_chunks
        metric("requests_total", "counter", "Requests ended, by finish reason or error.",
               [(f'{{outcome="{k}"}}', v) for k, v in sorted(requests.items())])  # fmt: skip
        metric("tokens_total", "counter", "Prompt tokens by where their KV came from, and tokens generated.",
               [(f'{{kind="{k}"}}', v) for k, v in sorted(tokens.items())])  # fmt: skip
        metric("pinned_chunks_total", "counter", "Chunks pinned by answered requests.", [("", pinned)])
        cumulative, samples = 0, []
        for bound, n in zip((*TTFT_BUCKETS, float("inf")), ttft, strict=True):
            cumulative += n
            samples.append((f'_bucket{{le="{"+Inf" if bound == float("inf") else bound}"}}', cumulative))
        samples += [("_sum", ttft_sum), ("_count", cumulative)]
        metric("ttft_seconds", "histogram", "Time to first token of answered requests.", samples)
        for name, (kind, help_, value) in readings.items():
            metric(name, kind, help_, [("", value)])
        return "\n".join(out) + "\n"
