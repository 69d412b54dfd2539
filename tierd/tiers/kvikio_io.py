"""Disk tier I/O through kvikio: GPUDirect Storage where the driver, the card
and the file system allow it, kvikio's own POSIX compatibility mode where they
do not. kvikio needs libcuda even in compatibility mode, so on a machine
without a driver the disk tier keeps its POSIX backend.

probe() decides once at start: kvikio importable, libcuda loadable, and a
self-test (write a pattern through kvikio, read it back, compare) passes.
Each slab file is opened twice: a plain descriptor the tier keeps for
fallocate and fdatasync (both act on the file, not the descriptor), and a
kvikio CuFile that carries the reads and writes.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any

import numpy as np

from tierd.tiers.fileops import FileOps

log = logging.getLogger("tierd.tiers.kvikio")
PROBE_BYTES = 1 << 20


class KvikioOps(FileOps):
    aligns_itself = True  # kvikio aligns or bounces what O_DIRECT and GDS need
    device_io = True  # CuFile reads into and writes from GPU memory (directly where GDS works)

    def __init__(self, kvikio: Any, mode: str) -> None:
        self.kvikio = kvikio
        self.name = f"kvikio-{mode}"
        self._files: dict[int, Any] = {}

    def open(self, path: str, flags: int, mode: int) -> int:
        fd = os.open(path, flags & ~os.O_DIRECT, mode)
        try:
            self._files[fd] = self.kvikio.CuFile(path, "r+")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def close(self, fd: int) -> None:
        cufile = self._files.pop(fd, None)
        try:
            if cufile is not None:
                cufile.close()
        finally:
            os.close(fd)

    def pread(self, fd: int, view: Any, offset: int) -> int:
        return int(self._files[fd].pread(view, view.nbytes, offset).get())

    def pwrite(self, fd: int, view: Any, offset: int) -> int:
        return int(self._files[fd].pwrite(view, view.nbytes, offset).get())


def _mode(kvikio: Any) -> str:
    """"gds" when kvikio drives cuFile, "compat" when it falls back to POSIX."""
    defaults = getattr(kvikio, "defaults", None)
    for ask in ("is_compat_mode_preferred", "compat_mode"):
        fn = getattr(defaults, ask, None)
        if callable(fn):
            try:
                return "compat" if fn() else "gds"
            except Exception:  # noqa: BLE001 - an API this version lacks: try the next
                continue
    return "compat"


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def probe(directory: str, kvikio: Any = None, need_driver: bool = True) -> tuple[KvikioOps | None, str]:
    """(ops, what was chosen) if kvikio works for slab files in directory,
    else (None, why not)."""
    if kvikio is None:
        try:
            import kvikio  # type: ignore[no-redef]
        except ImportError:
            return None, "kvikio is not installed"
        except Exception as exc:  # noqa: BLE001 - a broken install must not stop the daemon
            return None, f"kvikio failed to load ({exc})"
    if need_driver and not _driver_present():
        return None, "no CUDA driver (libcuda), which kvikio needs even in compatibility mode"
    ops = KvikioOps(kvikio, _mode(kvikio))
    path = os.path.join(directory, ".kvikio-probe")
    pattern = np.frombuffer(np.random.default_rng().bytes(PROBE_BYTES), dtype=np.uint8)
    back = np.zeros(PROBE_BYTES, dtype=np.uint8)
    fd = None
    try:
        fd = ops.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        os.posix_fallocate(fd, 0, PROBE_BYTES)
        if ops.pwrite(fd, pattern, 0) != PROBE_BYTES or ops.pread(fd, back, 0) != PROBE_BYTES:
            return None, "the kvikio self-test moved fewer bytes than asked"
        if not np.array_equal(pattern, back):
            return None, "the kvikio self-test read back other bytes than it wrote"
    except Exception as exc:  # noqa: BLE001 - any failure means: use POSIX
        return None, f"the kvikio self-test failed ({exc})"
    finally:
        if fd is not None:
            ops.close(fd)
        if os.path.exists(path):
            os.unlink(path)
    return ops, f"kvikio ({'GPUDirect Storage' if ops.name == 'kvikio-gds' else 'compatibility mode'})"
