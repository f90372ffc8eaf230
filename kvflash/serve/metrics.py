"""What `GET /metrics` reports, in Prometheus's text format through prometheus-client: a server's
counters and histograms, kept in a registry of its own (servers in one process stay apart), and the
engine's and the scheduler's state, read at each scrape (`render`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import prometheus_client
import torch
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvflash import kernels
from kvflash.serve.turn import TurnStats

if TYPE_CHECKING:
    from kvflash.serve.scheduler import StepTime

prometheus_client.disable_created_metrics()  # a `_created` series per counter tells a scraper nothing

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Upper bounds (seconds) of the time-to-first-token histogram."""
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
"""Upper bounds (seconds) of the inter-token latency histogram."""

STEP_BUCKETS = (0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
"""Upper bounds (seconds) of the step-time histograms: fine around a decode step's few milliseconds."""

Readings = dict[str, tuple[str, str, float]]
"""name -> (type "gauge" or "counter", help, value), read now from the engine and the scheduler."""


class ServerMetrics:
    """Counters a server adds to as requests run and end; `render` may run on another thread
    (prometheus-client's metrics lock themselves)."""

    def __init__(self, readings: Callable[[], Readings]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvflash_requests", "Requests ended, by finish reason (stop, length), cancelled (the client "
            "left), timeout, error (the engine failed it), full (KV memory other requests held: 503), "
            "down (the scheduler had stopped), refused (a bad request) or busy (the waiting queue was "
            "full).", ["outcome"], registry=r,
        )  # fmt: skip
        self.tokens = Counter(
            "kvflash_tokens", "Prompt tokens by where their KV came from (cold: prefilled; memory: the "
            "request's own live sequence; gpu, host: chunks other live sequences hold; disk, lazy: the "
            "store), and tokens generated.", ["kind"], registry=r,
        )  # fmt: skip
        self.moved = Counter(
            "kvflash_bytes_moved", "Bytes of chunk KV moved by answered requests, by tier (disk: read "
            "from the store; host_to_gpu; gpu_to_host).", ["tier"], registry=r,
        )  # fmt: skip
        self.evicted = Counter(
            "kvflash_evicted_chunks", "Chunks answered requests evicted from the pool.", registry=r
        )
        self.pinned = Counter("kvflash_pinned_chunks", "Chunks pinned by answered requests.", registry=r)
        self.saves = Counter(
            "kvflash_snapshot_saves", "Snapshots after an answer: saved, failed (the store refused it), "
            "deferred (writes were behind: staged once they catch up) or skipped (the deferred sequence "
            "had gone, or the server stopped first).", ["outcome"], registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "kvflash_ttft_seconds", "Time to first token of answered requests.", registry=r,
            buckets=TTFT_BUCKETS,
        )  # fmt: skip
        self.itl = Histogram(
            "kvflash_inter_token_seconds", "Time between a request's consecutive tokens.", registry=r,
            buckets=ITL_BUCKETS,
        )  # fmt: skip
        self.step = Histogram(
            "kvflash_step_seconds", "Wall time of the scheduler's steps, by kind (decode: decode tokens "
            "alone; mixed: decode tokens and prefill pieces; prefill: pieces alone).", ["kind"],
            registry=r, buckets=STEP_BUCKETS,
        )  # fmt: skip
        self.step_wait = Histogram(
            "kvflash_step_wait_seconds", "Of each step's time, the scheduler's wait for the device to "
            "give back the step's tokens (decode tokens, pieces' first tokens); the rest is the host's.",
            ["kind"], registry=r, buckets=STEP_BUCKETS,
        )  # fmt: skip
        r.register(_Now(readings))

    def stepped(self, t: StepTime) -> None:
        self.step.labels(t.kind).observe(t.seconds)
        self.step_wait.labels(t.kind).observe(t.waited)

    def answered(self, finish: str, stats: TurnStats) -> None:
        self.requests.labels(finish).inc()
        self.tokens.labels("cold").inc(stats.prefilled_tokens)
        if stats.source == "shared":
            self.tokens.labels("gpu").inc(stats.restored_tokens - stats.shared_host_tokens)
            self.tokens.labels("host").inc(stats.shared_host_tokens)
        elif stats.restored_tokens:
            self.tokens.labels(stats.source).inc(stats.restored_tokens)
        self.tokens.labels("generated").inc(stats.generated_tokens)
        for tier, n in stats.bytes_moved.items():
            self.moved.labels(tier).inc(n)
        self.evicted.inc(stats.evicted_chunks)
        self.pinned.inc(stats.pinned_chunks)
        self.ttft.observe(stats.ttft_s)

    def failed(self, outcome: str = "error") -> None:
        """A request that did not end in an answer: ended in the engine ("error", "full", "cancelled",
        "timeout", "down") or refused before it ("refused", "busy", "down")."""
        self.requests.labels(outcome).inc()

    def render(self) -> str:
        return prometheus_client.generate_latest(self.registry).decode()


def device_readings(device: torch.device) -> Readings:
    """On CUDA (none elsewhere): the kernel variants built, and the caching allocator's state: memory
    it holds from the driver, and how often it asked for more and had to free its cached blocks first
    (a retry frees and synchronises the whole device: a step that retries is slow for no reason its
    shapes show)."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {
        "kernel_variants_built_total": (
            "counter",
            "Triton kernel variants this process compiled or loaded since its warm-up began; one built "
            "while serving stalled the step that needed it.",
            kernels.variants.built(),
        ),
        "device_memory_reserved_bytes": (
            "gauge",
            "Device memory the allocator holds for tensors (the pool's included).",
            stats.get("reserved_bytes.all.current", 0),
        ),
        "device_mallocs_total": (
            "counter",
            "Device allocations the allocator made.",
            stats.get("num_device_alloc", 0),
        ),
        "device_alloc_retries_total": (
            "counter",
            "Allocations that found the device full and freed the allocator's cached blocks to retry.",
            stats.get("num_alloc_retries", 0),
        ),
    }


class _Now:
    """The readings of the moment, as metric families at each scrape."""

    def __init__(self, readings: Callable[[], Readings]):
        self.readings = readings

    def collect(self) -> Iterator[Metric]:
        for name, (kind, help_, value) in self.readings().items():
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(f"kvflash_{name}", help_, value=value)
