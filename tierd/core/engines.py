"""Registered engine memory: shared-memory regions mapped into the daemon.

Runs in the daemon. An engine names files in /dev/shm that hold its paged KV
cache; the daemon maps them once at registration and copies blocks straight
between them and its tiers. Names are checked (no path separators, no
symlinks followed) and engines are visible only to their own tenant.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import threading
import uuid
from dataclasses import dataclass, field

import numpy as np

from tierd.errors import InvalidArgument, NotFound, ResourceExhausted
from tierd.layout import EngineLayout, KVSpec
from tierd.transfer.copier import EngineMemory

SHM_DIR = "/dev/shm"
_SHM_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")
MAX_ENGINES_PER_TENANT = 64


@dataclass(eq=False)
class Engine:
    engine_id: str
    tenant: str
    spec: KVSpec
    memory: EngineMemory
    _maps: list[mmap.mmap] = field(default_factory=list)

    def close(self) -> None:
        self.memory.regions.clear()
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                pass  # a copy still holds a view; the mapping goes with it
        self._maps.clear()


def map_shm(name: str, size: int, shm_dir: str = SHM_DIR) -> mmap.mmap:
    """Map /dev/shm/<name> read-write; it must be a regular file of at least size bytes."""
    if not isinstance(name, str) or not _SHM_NAME.match(name) or ".." in name:
        raise InvalidArgument(f"shared-memory name {name!r} must be a plain file name in {shm_dir}", field="regions")
    if size <= 0:
        raise InvalidArgument(f"region {name!r} needs a positive size", field="regions")
    try:
        fd = os.open(os.path.join(shm_dir, name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NotFound(f"shared-memory region {name!r} does not exist", field="regions") from None
    except OSError as exc:
        raise InvalidArgument(f"cannot open shared-memory region {name!r}: {exc.strerror}", field="regions") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument(f"shared-memory region {name!r} is not a regular file", field="regions")
        if st.st_size < size:
            raise InvalidArgument(f"region {name!r} holds {st.st_size} bytes, fewer than the {size} declared",
                                  field="regions")
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


class EngineRegistry:
    def __init__(self, shm_dir: str = SHM_DIR) -> None:
        self.shm_dir = shm_dir
        self._engines: dict[str, Engine] = {}
        self._lock = threading.Lock()

    def register(self, tenant: str, spec: KVSpec, regions: list[tuple[str, int]], layout: EngineLayout) -> Engine:
        if not regions:
            raise InvalidArgument("an engine needs at least one memory region", field="regions")
        layout.check(spec, [size for _, size in regions])
        with self._lock:
            if sum(e.tenant == tenant for e in self._engines.values()) >= MAX_ENGINES_PER_TENANT:
                raise ResourceExhausted(f"at most {MAX_ENGINES_PER_TENANT} engines per tenant; unregister some")
        maps: list[mmap.mmap] = []
        try:
            for name, size in regions:
                maps.append(map_shm(name, size, self.shm_dir))
        except BaseException:
            for m in maps:
                m.close()
            raise
        memory = EngineMemory(layout, [np.frombuffer(m, dtype=np.uint8) for m in maps])
        engine = Engine(uuid.uuid4().hex, tenant, spec, memory, maps)
        with self._lock:
            self._engines[engine.engine_id] = engine
        return engine

    def get(self, tenant: str, engine_id: str) -> Engine:
        with self._lock:
            engine = self._engines.get(engine_id)
        if engine is None or engine.tenant != tenant:
            raise NotFound(f"engine {engine_id!r} is not registered", field="engine_id")
        return engine

    def unregister(self, tenant: str, engine_id: str) -> None:
        engine = self.get(tenant, engine_id)
        with self._lock:
            self._engines.pop(engine_id, None)
        engine.close()

    def close(self) -> None:
        with self._lock:
            engines, self._engines = list(self._engines.values()), {}
        for e in engines:
            e.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._engines)
