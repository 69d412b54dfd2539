"""The campaign's daemons: real `tierd serve` processes, each started with
libfiu's POSIX preload (Debian's fiu-utils, where present) so its disk
reads, writes and syncs can be made to fail while it runs, and with
libfaketime (where present) so a restart can find the wall clock moved.
Runs in the campaign's process."""

from __future__ import annotations

import glob
import os
import random
import re
import shutil
import signal
import subprocess
import threading
from pathlib import Path

from tierd.client import Client
from tierd.testing import Daemon

FIU_LIBS = ("/usr/lib/fiu/fiu_run_preload.so", "/usr/lib/fiu/fiu_posix_preload.so")
FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"
# The disk calls a storage fault fails: the slabs', the index's and the records' alike.
FIU_POINTS = ("posix/io/rw/pwrite", "posix/io/rw/pwritev", "posix/io/rw/pread", "posix/io/rw/preadv",
              "posix/io/sync/fsync", "posix/io/sync/fdatasync")


def have_fiu() -> bool:
    return all(os.path.exists(p) for p in FIU_LIBS) and shutil.which("fiu-ctrl") is not None


def have_faketime() -> bool:
    return os.path.exists(FAKETIME_LIB)


class Node:
    def __init__(self, index: int, root: Path, flags: list[str]) -> None:
        self.index = index
        self.fiu_base = str(root / f"fiu{index}")
        self.daemon = Daemon(root / f"node{index}", *flags)
        self.lock = threading.Lock()  # one process fault at a time
        self.up = False
        self.clock = ""  # FAKETIME's offset for the next start ("": the true clock)

    @property
    def socket(self) -> str:
        return self.daemon.socket

    def client(self, token: str, timeout: float = 20.0) -> Client:
        return Client(self.socket, token=token, timeout=timeout)

    def start(self) -> None:
        preload = list(FIU_LIBS) if have_fiu() else []
        env = {"FIU_CTRL_FIFO": self.fiu_base, "FIU_ENABLE": ""} if preload else {}
        if self.clock and have_faketime():
            preload.append(FAKETIME_LIB)
            env["FAKETIME"] = self.clock
        if preload:
            env["LD_PRELOAD"] = " ".join(preload)
        self.daemon.env = env
        self.daemon.start(timeout=180)
        self.up = True

    def kill(self) -> None:
        self.up = False
        self.daemon.kill()

    def pause(self, stop: bool) -> None:
        os.kill(self.daemon.pid(), signal.SIGSTOP if stop else signal.SIGCONT)

    def disk_faults(self, errno_: int | None, probability: float = 1.0) -> bool:
        """Fail the disk calls (errno_ None: stop failing them); False where
        libfiu is absent or the daemon is not running."""
        if not have_fiu() or not self.up:
            return False
        if errno_ is None:
            commands = [f"disable name={p}" for p in FIU_POINTS]
        else:
            commands = [f"enable_random name={p},probability={probability},failinfo={errno_}" for p in FIU_POINTS]
        args = ["fiu-ctrl", "-f", self.fiu_base]
        for c in commands:
            args += ["-c", c]
        try:
            return subprocess.run(args + [str(self.daemon.pid())], capture_output=True, timeout=30).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def files(self, pattern: str) -> list[str]:
        return sorted(glob.glob(os.path.join(self.daemon.data_dir, "**", pattern), recursive=True))

    def damage(self, rng: random.Random) -> str:
        """Damage the stopped daemon's files one way, chosen by rng; what was done."""
        slabs, index, records = self.files("slab-*.bin"), self.files("index.db"), self.files("records.bin")
        way = rng.choice(["flip slab", "truncate slab", "delete slab", "garble index", "delete index",
                          "flip records", "delete records"])
        target = {"slab": slabs, "index": index, "records": records}[way.split()[1]]
        if not target:
            return f"{way}: none there"
        path = rng.choice(target)
        size = os.path.getsize(path)
        if way.startswith("delete"):
            os.unlink(path)
            for extra in glob.glob(path + "-*"):  # the index's journal
                os.unlink(extra)
        elif way.startswith("truncate"):
            os.truncate(path, rng.randrange(0, max(1, size)))
        else:  # flip or garble: bytes overwritten at random places
            with open(path, "r+b") as f:
                for _ in range(8 if way.startswith("flip") else 64):
                    if size:
                        f.seek(rng.randrange(size))
                        f.write(os.urandom(rng.choice([1, 8, 512])))
        return f"{way} {os.path.basename(path)}"

    def heap(self) -> int:
        """The daemon's private heap (RssAnon, bytes): shared memory (the host
        tier, engines' regions) not counted."""
        try:
            with open(f"/proc/{self.daemon.pid()}/status") as f:
                m = re.search(r"RssAnon:\s+(\d+) kB", f.read())
        except OSError:
            return 0
        return int(m.group(1)) * 1024 if m else 0

    def close(self) -> None:
        self.up = False
        if self.daemon.proc is not None and self.daemon.proc.poll() is None:
            try:
                self.pause(False)
            except ProcessLookupError:
                pass
        self.daemon.close()
