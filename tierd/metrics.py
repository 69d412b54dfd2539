"""Prometheus metrics: every name starts with tierd_ and carries its unit;
labels are tiers, routes, reasons, methods and codes, never session or
tenant ids. The registry is injected, so tests build their own.

Metrics listens to the store (StoreEvents) and reads tier occupancy and
copy-engine figures at scrape time through a collector.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tierd import __version__

_ERRORS = (0.0, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2)
_LATENCY = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.moves = Counter("tierd_moves_total", "Tier-to-tier moves completed", ["src", "dst", "reason"],
                             registry=registry)
        self.moved_bytes = Counter("tierd_moved_bytes_total", "Bytes moved between tiers", ["src", "dst", "reason"],
                                   registry=registry)
        self.move_seconds = Histogram("tierd_move_seconds", "Time of one move", ["src", "dst"], buckets=_LATENCY,
                                      registry=registry)
        self.saved_bytes = Counter("tierd_saved_bytes_total", "Bytes stored by Save and Put", ["tier"], registry=registry)
        self.save_seconds = Histogram("tierd_save_seconds", "Time to store a snapshot", ["tier"], buckets=_LATENCY,
                                      registry=registry)
        self.restored_bytes = Counter("tierd_restored_bytes_total", "Bytes served by Restore and Get", ["source"],
                                registry=registry)
        self.restore_seconds = Histogram("tierd_restore_seconds", "Time to serve a snapshot", ["source"],
                                         buckets=_LATENCY, registry=registry)
        self.rpc_seconds = Histogram("tierd_rpc_seconds", "gRPC call latency", ["method"], buckets=_LATENCY,
                                     registry=registry)
        self.rpc_errors = Counter("tierd_rpc_errors_total", "Failed gRPC calls", ["method", "code"],
                                  registry=registry)
        self.rpc_in_flight = Gauge("tierd_rpc_in_flight", "gRPC calls being served (waiting ones included)",
                                   ["method"], registry=registry)
        self.prefetches = Counter("tierd_prefetch_total", "Prefetch outcomes: ready, in_time, late, missed",
                                  ["outcome"], registry=registry)
        self.checksum_failures = Counter("tierd_checksum_failures_total", "Pages that failed their checksum",
                                         ["tier"], registry=registry)
        self.evictions = Counter("tierd_evictions_total", "Sessions leaving a tier, by reason", ["tier", "reason"],
                                 registry=registry)
        self.disk_errors = Counter("tierd_disk_errors_total", "Disk I/O errors", ["op"], registry=registry)
        self.leases_expired = Counter("tierd_leases_expired_total", "Leases not ended in time (save, restore)",
                                      ["kind"], registry=registry)
        self.quarantined_sessions = Counter("tierd_sessions_quarantined_total", "Sessions found damaged at start "
                                            "(a bad index row, a lost slab) and not served", ["reason"],
                                            registry=registry)
        self.remote_ops = Counter("tierd_remote_ops_total", "Remote tier calls that did not simply succeed, "
                                  "publishes, and reads its change notices answered: op (manifest, fetch, publish, "
                                  "drop, ...), outcome (ok, conflict, quota, queue_full, unavailable, unreplicated, "
                                  "known)",
                                  ["op", "outcome"], registry=registry)
        self.prefix_hits = Counter("tierd_prefix_hits_total", "Calls answered from pages other sessions of the "
                                   "tenant hold (prefix sharing): save, restore, lookup", ["call"], registry=registry)
        self.prefix_pages = Counter("tierd_prefix_pages_total", "Pages taken from other sessions of the tenant "
                                    "instead of stored again (save) or computed again (restore)", ["call"],
                                    registry=registry)
        self.codec_bytes = Counter("tierd_codec_bytes_total", "Bytes of pages coded (op encode) and decoded (op "
                                   "decode), by codec: form logical (the pages) or coded (what the tier holds)",
                                   ["codec", "op", "form"], registry=registry)
        self.codec_seconds = Counter("tierd_codec_seconds_total", "Seconds spent coding and decoding pages, by "
                                     "codec", ["codec", "op"], registry=registry)
        self.codec_errors = Histogram("tierd_codec_page_rel_error", "Relative L2 error of each page a lossy codec "
                                      "coded, by codec", ["codec"], buckets=_ERRORS, registry=registry)
        self.codec_auto = Gauge("tierd_codec_auto", "With --codec TIER=auto: 1 for the codec auto codes the tier's "
                                "pages with now (by measured speed), 0 for the other", ["tier", "codec"],
                                registry=registry)
        self.remote_reachable: Gauge | None = None  # made by set_backends where there is a remote tier
        self.info = Info("tierd_build", "Version and the backends chosen at start", registry=registry)
        ProcessCollector(namespace="tierd", registry=registry)  # RSS, open files, CPU of the daemon
        self.info.info({"version": __version__})

    def set_backends(self, backends: dict[str, str]) -> None:
        self.info.info({"version": __version__, **backends})
        if backends.get("remote", "absent") != "absent" and self.remote_reachable is None:
            self.remote_reachable = Gauge("tierd_remote_up", "1 while the remote tier answers, 0 after a call to it "
                                          "failed", registry=self.registry)
            self.remote_reachable.set(1)

    def watch(self, store: Any) -> None:
        """Report the store's tiers and copy engine at every scrape."""
        self.registry.register(_StoreCollector(store))

    # StoreEvents ------------------------------------------------------------

    def moved(self, src: str, dst: str, reason: str, nbytes: int, seconds: float) -> None:
        self.moves.labels(src, dst, reason).inc()
        self.moved_bytes.labels(src, dst, reason).inc(nbytes)
        self.move_seconds.labels(src, dst).observe(seconds)

    def saved(self, tier: str, nbytes: int, seconds: float) -> None:
        self.saved_bytes.labels(tier).inc(nbytes)
        self.save_seconds.labels(tier).observe(seconds)

    def restored(self, source: str, nbytes: int, seconds: float) -> None:
        self.restored_bytes.labels(source).inc(nbytes)
        self.restore_seconds.labels(source).observe(seconds)

    def checksum_failed(self, tier: str) -> None:
        self.checksum_failures.labels(tier).inc()

    def evicted(self, tier: str, reason: str) -> None:
        self.evictions.labels(tier, reason).inc()

    def prefetch_outcome(self, outcome: str) -> None:
        self.prefetches.labels(outcome).inc()

    def disk_error(self, op: str) -> None:
        self.disk_errors.labels(op).inc()

    def lease_expired(self, kind: str) -> None:
        self.leases_expired.labels(kind).inc()

    def quarantined(self, reason: str) -> None:
        self.quarantined_sessions.labels(reason).inc()

    def remote_op(self, op: str, outcome: str) -> None:
        self.remote_ops.labels(op, outcome).inc()

    def coded(self, codec: str, op: str, nbytes: int, coded: int, seconds: float) -> None:
        self.codec_bytes.labels(codec, op, "logical").inc(nbytes)
        self.codec_bytes.labels(codec, op, "coded").inc(coded)
        self.codec_seconds.labels(codec, op).inc(seconds)

    def coding_errors(self, codec: str, rel_errors: Any) -> None:
        histogram = self.codec_errors.labels(codec)
        for value in rel_errors:
            histogram.observe(float(value))

    def codec_chosen(self, tier: str, codec: str, among: tuple[str, ...]) -> None:
        for name in among:
            self.codec_auto.labels(tier, name).set(int(name == codec))

    def remote_up(self, up: bool) -> None:
        if self.remote_reachable is not None:
            self.remote_reachable.set(int(up))

    def shared(self, call: str, pages: int, nbytes: int) -> None:
        self.prefix_hits.labels(call).inc()
        if pages:
            self.prefix_pages.labels(call).inc(pages)

    # RPCs -----------------------------------------------------------------------

    def rpc_started(self, method: str) -> None:
        self.rpc_in_flight.labels(method).inc()

    def rpc(self, method: str, seconds: float, code: str | None) -> None:
        self.rpc_in_flight.labels(method).dec()
        self.rpc_seconds.labels(method).observe(seconds)
        if code is not None:
            self.rpc_errors.labels(method, code).inc()


class _StoreCollector:
    def __init__(self, store: Any) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        stats = self.store.stats()
        gauges: dict[str, tuple[str, Callable[[Any], float]]] = {
            "tierd_tier_used_bytes": ("Bytes held in the tier", lambda t: t.used),
            "tierd_tier_budget_bytes": ("The tier's budget", lambda t: t.budget),
            "tierd_tier_capacity_bytes": ("Bytes the tier has mapped or preallocated", lambda t: t.capacity),
            "tierd_tier_sessions": ("Sessions with pages in the tier", lambda t: t.sessions),
            "tierd_tier_shared_saved_bytes": ("Bytes the tier would hold more if pages sessions share (prefix "
                                              "sharing) were stored once per session", lambda t: t.saved),
        }
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily(name, doc, labels=["tier"])
            for t in stats:
                g.add_metric([t.name], value(t))
            yield g
        full = GaugeMetricFamily("tierd_tier_out_of_space", "1 while the file system under the tier is full "
                                 "(demotion to it pauses)", labels=["tier"])
        for name, tier in self.store.tiers.items():
            full.add_metric([name], float(tier.out_of_space))
        yield full
        backend = GaugeMetricFamily("tierd_tier_backend_info", "The mechanism behind each tier (value 1)",
                                    labels=["tier", "backend"])
        for t in stats:
            backend.add_metric([t.name, t.backend], 1)
        yield backend
        copier = self.store.copier
        yield CounterMetricFamily("tierd_copy_operations", "Copy operations issued by the copy engine",
                                  value=copier.copy_ops)
        bw = GaugeMetricFamily("tierd_route_bandwidth_bytes_per_second", "Moving average of measured bandwidth",
                               labels=["route"])
        for route, value in sorted(copier.bandwidth.items()):
            bw.add_metric([route], value)
        yield bw
        if self.store.remote is not None:
            yield GaugeMetricFamily("tierd_remote_notices", "1 while the remote tier's change notices are live (a "
                                    "read of a copy nothing changed asks the tier nothing), 0 while every read asks",
                                    value=float(self.store.remote.store.hears_changes()))
        sessions = GaugeMetricFamily("tierd_sessions", "Sessions held")
        sessions.add_metric([], self.store.count())
        yield sessions
