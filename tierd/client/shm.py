"""Engine-side shared memory: a paged KV cache the daemon can read and write.

An engine that keeps its KV cache in these regions lets tierd save and
restore blocks with no bytes in messages: register the cache once, then call
save and restore with block ids.
"""

from __future__ import annotations

import mmap
import os
import uuid

import numpy as np

from tierd.layout import EngineLayout, KVSpec

SHM_DIR = "/dev/shm"


class SharedKVCache:
    """KV blocks in /dev/shm files: one per layer and K/V ("layer_major", as
    vLLM and SGLang keep them) or one holding whole pages ("cross_layer")."""

    def __init__(self, spec: KVSpec, num_blocks: int, kind: str = "layer_major", prefix: str | None = None) -> None:
        if kind not in ("layer_major", "cross_layer"):
            raise ValueError(f"kind must be layer_major or cross_layer, not {kind!r}")
        self.spec = spec
        self.layout = (EngineLayout.layer_major if kind == "layer_major" else EngineLayout.cross_layer)(spec, num_blocks)
        prefix = prefix or f"tierd-kv-{uuid.uuid4().hex[:12]}"
        n_regions = 2 * spec.num_layers if kind == "layer_major" else 1
        size = num_blocks * self.layout.segments[0].stride
        self.names = [f"{prefix}.{i}" for i in range(n_regions)]
        self.sizes = [size] * n_regions
        self._maps: list[mmap.mmap] = []
        self.regions: list[np.ndarray] = []
        for name in self.names:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, size)
                m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            self._maps.append(m)
            self.regions.append(np.frombuffer(m, dtype=np.uint8))

    def block(self, region: int, block: int) -> np.ndarray:
        """One block's bytes in one region (a view)."""
        seg = self.layout.segments[region]
        return self.regions[seg.region][seg.offset + block * seg.stride : seg.offset + block * seg.stride + seg.nbytes]

    def close(self) -> None:
        """Unmap and remove the files."""
        self.regions.clear()
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                pass
        self._maps.clear()
        for name in self.names:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass

    def __enter__(self) -> SharedKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
