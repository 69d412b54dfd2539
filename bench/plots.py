"""PNG plots of the figures where a picture helps (needs matplotlib)."""

from __future__ import annotations

import os

from bench.common import Result


def write(results: list[Result], directory: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    os.makedirs(directory, exist_ok=True)
    by_name = {r.name: r for r in results}
    written = []

    sweep = by_name.get("host_restore_vs_memcpy")
    if sweep is not None and sweep.series:
        s = sweep.series
        fig, ax = plt.subplots(figsize=(7, 4))
        mib = np.array(s["bytes"]) / (1 << 20)
        for name, style in (("memcpy", "k--"), ("restore", "o-"), ("save", "s-")):
            ax.plot(mib, s[name], style, label=name if name == "memcpy" else f"tierd {name}")
        ax.set_xscale("log")
        written.append(_save(fig, ax, "snapshot size (MiB)", "GB/s", "Host tier through shared memory, beside memcpy",
                             directory, "host_bandwidth_by_size.png"))

    latency = by_name.get("control_rpc_p99_ms")
    if latency is not None and latency.series:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, label in (("tierd_ms", "tierd Stat and Prefetch"), ("bare_grpc_ms", "bare gRPC echo")):
            x = np.sort(latency.series[name])
            ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=label)
        ax.set_xscale("log")
        written.append(_save(fig, ax, "latency (ms)", "fraction of calls", "Control calls under 8 concurrent clients",
                             directory, "control_latency_cdf.png"))

    trace = by_name.get("trace_prefetch_on_time")
    if trace is not None and trace.series:
        s = trace.series
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(s["t"], np.array(s["host"]) / (1 << 20), label="host used")
        ax.plot(s["t"], np.array(s["disk"]) / (1 << 20), label="disk used")
        ax.axhline(s["host_budget"] / (1 << 20), color="k", linestyle="--", label="host budget")
        written.append(_save(fig, ax, "seconds into the trace", "MiB", "Tier occupancy during the trace replay",
                             directory, "trace_occupancy.png"))
    return written


def _save(fig, ax, xlabel: str, ylabel: str, title: str, directory: str, name: str) -> str:
    """Label the axes, add the legend and write the PNG; returns its path."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    path = os.path.join(directory, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
