"""tierd: a KV-cache tiering daemon that keeps per-session KV snapshots across
GPU VRAM, pinned host RAM and NVMe, and moves them by policy."""

__version__ = "0.1.0"
