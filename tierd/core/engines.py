"""Registered engine memory: shared-memory regions and GPU memory mapped
into the daemon.

Runs in the daemon (on the RPC threads). An engine hands over open
descriptors of the shared memory holding its paged KV cache (wire/fds.py
checks them: shared memory of the engine's own user, never the daemon's),
or exports its GPU allocations as CUDA IPC handles; the daemon maps or opens
them once at registration and copies blocks straight between them and its
tiers. Engines are visible only to their own tenant. An engine registered with
its process id is unregistered when that process exits, and its memory is
released once the calls using it have finished.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import stat
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from tierd.core.cuda_ipc import IpcCache, IpcRegion
from tierd.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    shown,
)
from tierd.layout import EngineLayout, KVSpec
from tierd.transfer.copier import EngineMemory

log = logging.getLogger("tierd.core.engines")
MAX_ENGINES_PER_TENANT = 64
MAX_REGIONS = 4096  # regions one engine may name (a layer-major layout has two a layer)
# Mappings of shared memory a tenant's engines may hold at once: each keeps a
# descriptor open in the daemon, and the daemon's descriptors serve everyone.
MAX_MAPPED_PER_TENANT = 2048


@dataclass(eq=False)
class Engine:
    engine_id: str
    tenant: str
    spec: KVSpec
    memory: EngineMemory
    _maps: list[mmap.mmap] = field(default_factory=list)
    _ipc: list[IpcRegion] = field(default_factory=list)
    _ipc_cache: IpcCache | None = None
    process: tuple[int, int] | None = None  # (pid, start time): whose exit unregisters the engine
    _users: int = 0
    _closing: bool = False
    _idle: threading.Condition = field(default_factory=threading.Condition)

    def enter(self) -> bool:
        with self._idle:
            if self._closing:
                return False
            self._users += 1
            return True

    def leave(self) -> None:
        with self._idle:
            self._users -= 1
            self._idle.notify_all()

    def close(self) -> None:
        """Release the memory once no call uses it (new calls are refused from now)."""
        with self._idle:
            self._closing = True
            while self._users:
                self._idle.wait()
        self.memory.regions.clear()
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                pass  # a copy still holds a view; the mapping goes with it
        self._maps.clear()
        for region in self._ipc:
            self._ipc_cache.release(region)
        self._ipc.clear()


def _proc_stat(pid: int) -> list[bytes]:
    """The fields of /proc/<pid>/stat after the command name (which may hold
    spaces): state first, start time (field 22) at index 19."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            line = f.read()
    except OSError:
        raise InvalidArgument(f"process {pid} is not visible to the daemon (is it running, in the daemon's pid "
                              "namespace?); register with pid 0 to skip watching it", field="pid") from None
    return line[line.rindex(b")") + 2 :].split()


def process_identity(pid: int) -> tuple[int, int]:
    """(pid, start time in clock ticks since boot): a pid reused by a later
    process has another start time."""
    return pid, int(_proc_stat(pid)[19])


def process_alive(identity: tuple[int, int]) -> bool:
    """Whether that process still runs (a zombie has exited: its GPU memory is gone)."""
    try:
        fields = _proc_stat(identity[0])
    except InvalidArgument:
        return False
    return int(fields[19]) == identity[1] and fields[0] not in (b"Z", b"X")


def map_fd(fd: int, size: int, index: int) -> mmap.mmap:
    """Map size bytes of an open shared-memory descriptor read-write; it must be
    a regular file of at least size bytes."""
    if size <= 0:
        raise InvalidArgument(f"region {index} needs a positive size", field="regions")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise InvalidArgument(f"region {index} is not a regular file", field="regions")
    if st.st_size < size:
        raise InvalidArgument(f"region {index} holds {st.st_size} bytes, fewer than the {size} declared",
                              field="regions")
    try:
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        raise InvalidArgument(f"cannot map region {index}: {exc.strerror}", field="regions") from None


class EngineRegistry:
    def __init__(self, ipc: IpcCache | None = None) -> None:
        self.ipc = ipc  # None where the daemon has no GPU
        self._engines: dict[str, Engine] = {}
        self._lock = threading.Lock()

    def register(self, tenant: str, spec: KVSpec, regions: list[tuple[str, int] | IpcRegion], layout: EngineLayout,
                 pid: int = 0) -> Engine:
        """Map or open the regions: (open shared-memory descriptor, size) pairs
        (the caller closes the descriptors) or IpcRegions, not both."""
        if not regions:
            raise InvalidArgument("an engine needs at least one memory region", field="regions")
        if len(regions) > MAX_REGIONS:
            raise InvalidArgument(f"an engine names at most {MAX_REGIONS} regions, not {len(regions)}",
                                  field="regions")
        ipc = [r for r in regions if isinstance(r, IpcRegion)]
        if ipc and len(ipc) != len(regions):
            raise InvalidArgument("an engine's regions are all shared memory or all CUDA IPC", field="regions")
        if ipc and self.ipc is None:
            raise FailedPrecondition("CUDA IPC regions need a daemon running on a GPU machine; this one has no "
                                     "device tier", field="regions")
        layout.check(spec, [r.size if isinstance(r, IpcRegion) else r[1] for r in regions])
        process = process_identity(pid) if pid else None
        with self._lock:
            if sum(e.tenant == tenant for e in self._engines.values()) >= MAX_ENGINES_PER_TENANT:
                raise ResourceExhausted(f"at most {MAX_ENGINES_PER_TENANT} engines per tenant; unregister some")
        engine = self._open(tenant, spec, regions, ipc, layout)
        engine.process = process
        with self._lock:
            held = sum(len(e._maps) for e in self._engines.values() if e.tenant == tenant)
            if held + len(engine._maps) <= MAX_MAPPED_PER_TENANT:
                self._engines[engine.engine_id] = engine
                return engine
        engine.close()
        raise ResourceExhausted(f"a tenant's engines may map {MAX_MAPPED_PER_TENANT} shared-memory descriptors at "
                                f"once; this tenant's map {held} and this engine {len(engine._maps)} more: "
                                "unregister some", limit=MAX_MAPPED_PER_TENANT, held=held)

    def _open(self, tenant: str, spec: KVSpec, regions: list, ipc: list[IpcRegion], layout: EngineLayout) -> Engine:
        if ipc:
            opened: list[IpcRegion] = []
            tensors = []
            try:
                for r in ipc:
                    tensors.append(self.ipc.acquire(r))
                    opened.append(r)
            except BaseException:
                for r in opened:
                    self.ipc.release(r)
                raise
            return Engine(uuid.uuid4().hex, tenant, spec, EngineMemory(layout, tensors), _ipc=opened,
                          _ipc_cache=self.ipc)
        # One mapping per descriptor, however many regions name it (each keeps a descriptor open).
        sizes: dict[int, tuple[int, int]] = {}  # fd -> (bytes the largest region needs, first region's index)
        for i, (fd, size) in enumerate(regions):
            if size <= 0:
                raise InvalidArgument(f"region {i} needs a positive size", field="regions")
            sizes[fd] = (max(size, sizes[fd][0]), sizes[fd][1]) if fd in sizes else (size, i)
        maps: dict[int, mmap.mmap] = {}
        try:
            for fd, (size, i) in sizes.items():
                maps[fd] = map_fd(fd, size, i)
        except BaseException:
            for m in maps.values():
                m.close()
            raise
        memory = EngineMemory(layout, [np.frombuffer(maps[fd], dtype=np.uint8, count=size) for fd, size in regions])
        return Engine(uuid.uuid4().hex, tenant, spec, memory, list(maps.values()))

    def get(self, tenant: str, engine_id: str) -> Engine:
        with self._lock:
            engine = self._engines.get(engine_id)
        if engine is None or engine.tenant != tenant:
            raise NotFound(f"engine {shown(engine_id)} is not registered", field="engine_id")
        return engine

    @contextlib.contextmanager
    def use(self, tenant: str, engine_id: str) -> Iterator[Engine]:
        """The engine, kept open until the block ends."""
        engine = self.get(tenant, engine_id)
        if not engine.enter():
            raise NotFound(f"engine {shown(engine_id)} is being unregistered", field="engine_id")
        try:
            yield engine
        finally:
            engine.leave()

    def unregister(self, tenant: str, engine_id: str) -> None:
        engine = self.get(tenant, engine_id)
        with self._lock:
            self._engines.pop(engine_id, None)
        engine.close()

    def reap(self) -> list[Engine]:
        """Unregister the engines whose process has exited; returns them."""
        with self._lock:
            gone = [e for e in self._engines.values() if e.process is not None and not process_alive(e.process)]
            for e in gone:
                self._engines.pop(e.engine_id, None)
        for e in gone:
            log.info("engine %s: process %d exited; its memory is released", e.engine_id, e.process[0])
            e.close()
        return gone

    def close(self) -> None:
        with self._lock:
            engines, self._engines = list(self._engines.values()), {}
        for e in engines:
            e.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._engines)
