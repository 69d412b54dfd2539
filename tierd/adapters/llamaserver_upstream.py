"""The llama-servers behind tierd's front (adapters/llamaserver.py): an
upstream's address, what its /props and /slots say, the identity its states
are stored under; its slots, and the slot files the front and llama-server
hand states through; the states staged ahead of their turns. Runs in the front's process, on its HTTP threads."""

from __future__ import annotations

import http.client
import json
import os
import secrets
import stat
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tierd.adapters.llamacpp_state import fingerprint, gguf_kind
from tierd.adapters.staged import StagedRestore
from tierd.client import Client, KVSpec
from tierd.types import Lease

PAGE_BYTES = 1 << 20  # pages of the stored snapshots
STAGES = 16  # conversations staged at once, at most


class Upstream:
    """One llama-server: its address and what /props says of it."""

    def __init__(self, url: str, kv_settings: str = "", timeout: float = 60.0, api_key: str | None = None) -> None:
        parsed = urllib.parse.urlsplit(url if "//" in url else f"http://{url}")
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"an upstream is http://HOST:PORT, got {url!r}")
        self.url, self.host, self.port = url, parsed.hostname, parsed.port or 80
        self.kv_settings, self.timeout = kv_settings, timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.slots = 0
        self.kind = "unknown"  # the model's, as last seen
        self._kinds: dict[str, str] = {}  # fingerprint -> kind

    def connect(self, timeout: float | None = None) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout or self.timeout)

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """A call of the front's own: (status, the JSON it answered)."""
        conn = self.connect()
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, data, self.headers | ({"Content-Type": "application/json"} if data else {}))
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        try:
            return resp.status, json.loads(raw) if raw else None
        except ValueError:
            return resp.status, None

    def props(self) -> dict[str, Any]:
        status, props = self.call("GET", "/props")
        if status != 200 or not isinstance(props, dict) or not props.get("model_path"):
            raise ConnectionError(f"llama-server at {self.url} answered /props with {status}")
        return props

    def spec(self) -> tuple[KVSpec, str]:
        """The identity its states are stored under, now, and the model's kind."""
        props = self.props()
        path = str(props["model_path"])
        model = fingerprint(path)
        if model not in self._kinds:
            self._kinds[model] = gguf_kind(path)
        self.kind = self._kinds[model]
        spec = KVSpec.opaque(f"llama.cpp/{model}", f"llama-server-{props.get('build_info', '')}",
                             page_bytes=PAGE_BYTES, extra=f"settings={self.kv_settings}")
        return spec, self.kind

    def slot_view(self, slot_id: int) -> dict[str, Any] | None:
        """What /slots says of one slot; None where it cannot be had."""
        try:
            status, slots = self.call("GET", "/slots")
        except OSError:
            return None
        if status != 200 or not isinstance(slots, list):
            return None
        return next((s for s in slots if isinstance(s, dict) and s.get("id") == slot_id), None)


@dataclass(eq=False)
class Slot:
    upstream: Upstream
    id: int
    file: str  # the slot's file in the slot directory
    busy: bool = False
    serving: str | None = None  # the conversation whose call holds it (a second call of it waits)
    session: str | None = None  # the conversation its state is, as stored
    tokens: int = 0  # and its tokens
    task: int | None = None  # llama-server's task that last ran in it
    dirty: bool = False  # its conversation's last turn is not stored
    used: float = 0.0

    @property
    def filename(self) -> str:
        return os.path.basename(self.file)


def check_slot_dir(path: str) -> str:
    """The slot directory, made if missing: the front's and llama-server's
    alone (owned by this user, not writable by others), as the slot files
    hold conversations' state."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"--slot-dir {path} is not a directory")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise ValueError(f"--slot-dir {path} must be this user's and not writable by group or others "
                         f"(mode {stat.filemode(st.st_mode)}): it holds the slots' state")
    return os.path.realpath(path)


def wait_upstreams(upstreams: list[Upstream], timeout: float) -> None:
    """Each upstream's slots, once it answers /props (llama-server loads its model first)."""
    deadline = time.monotonic() + timeout
    for u in upstreams:
        while True:
            try:
                u.slots = int(u.props().get("total_slots") or 0)
                if u.slots <= 0:
                    raise ValueError(f"llama-server at {u.url} has no slots")
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise ConnectionError(f"llama-server at {u.url} did not answer in {timeout:g} s: {exc}") from None
                time.sleep(0.2)


def read_into(path: str, view: memoryview) -> None:
    """The whole file at path into view (its size), not through a link."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        done = 0
        while done < len(view):
            n = os.readv(fd, [view[done:]])
            if n <= 0:
                raise OSError(f"the slot file {path} ended at {done} of {len(view)} bytes")
            done += n
    finally:
        os.close(fd)


def write_from(path: str, view: memoryview) -> None:
    """A file at path (this user's alone, not through a link) holding view."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
    finally:
        os.close(fd)


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@dataclass(eq=False)
class Staged:
    """A conversation's state staged: its restore lease, and the name in the
    slot directory its bytes are placed at as it is staged (Stages.place; a
    name of its own: a stage begun while another of the conversation is read
    never places anything at that one's name)."""

    restore: StagedRestore
    file: str

    def drop(self) -> None:
        unlink(self.file)  # (first: the name never outlives the lease it links to)
        self.restore.drop()


class Stages:
    """Conversations' states staged ahead of their turns: each a restore
    lease begun on a thread of its own, its bytes then placed at a name of
    the slot directory (place()), so that the turn's restore has llama-server
    read what is there already; at most STAGES, the oldest dropped."""

    def __init__(self, client: Client, slot_dir: str, mapped: Callable[[Lease], Any], shm_dir: str) -> None:
        self.client, self.slot_dir, self.mapped, self.shm_dir = client, slot_dir, mapped, shm_dir
        self._stages: dict[str, Staged] = {}
        self._lock = threading.Lock()

    def begin(self, sid: str, spec: KVSpec) -> None:
        """Stage the session's state under spec; nothing where it is staged already."""
        file = os.path.join(self.slot_dir, f"tierd-stage-{secrets.token_hex(8)}.bin")
        staged = Staged(StagedRestore(self.client, spec, lambda lease: self.place(file, lease)), file)
        with self._lock:
            if sid in self._stages:
                return
            self._stages[sid] = staged
            old = list(self._stages)[:-STAGES]
        for other in old:
            self.drop(other)
        staged.restore.begin(sid)

    def take(self, sid: str) -> Staged | None:
        with self._lock:
            return self._stages.pop(sid, None)

    def state_file(self, sid: str, spec: KVSpec, slot_file: str) -> tuple[str, Callable[[], bool]]:
        """The conversation's state under spec at a name in the slot
        directory, and what ends its restore lease once llama-server has read
        it (whether it was read in time): the name its stage placed it at,
        else slot_file, placed now. Raises what begin_restore raised."""
        staged = self.take(sid)
        if staged is not None and staged.restore.spec != spec:  # staged before llama-server's model changed
            threading.Thread(target=staged.drop, name="tierd-unstage", daemon=True).start()
            staged = None
        if staged is not None:
            try:
                held = staged.restore.take(sid)
            except OSError:  # it could not be placed (a full /dev/shm, say): read again below
                held = None
            except BaseException:
                unlink(staged.file)
                raise
            if held is not None:
                return staged.file, lambda: staged.restore.end(held)
            unlink(staged.file)
        restore = StagedRestore(self.client, spec)
        held = restore.hold(sid)
        try:
            self.place(slot_file, held.lease)
        except BaseException:
            restore.end(held)
            raise
        return slot_file, lambda: restore.end(held)

    def place(self, path: str, lease: Lease) -> None:
        """A restore lease's bytes at path in the slot directory: a link to
        the lease's segment, which llama-server reads as it is (the state from
        its first byte; it reads no further than the state, and the daemon
        zeroes the rest), else a file written from it. Either stays the
        conversation's while the lease is held."""
        unlink(path)
        if len(lease.slots) == 1 and lease.slots[0].offset == 0 and lease.page_stride == lease.page_bytes:
            os.symlink(os.path.join(self.shm_dir, lease.slots[0].shm_name), path)
        else:
            write_from(path, memoryview(self.mapped(lease))[: lease.nbytes])

    def drop(self, sid: str) -> None:
        """End the session's staged lease, if any, and remove its name, off the caller's path."""
        staged = self.take(sid)
        if staged is not None:
            threading.Thread(target=staged.drop, name="tierd-unstage", daemon=True).start()

    def ready(self) -> list[str]:
        with self._lock:
            return sorted(sid for sid, staged in self._stages.items() if staged.restore.wait(0))

    def close(self) -> None:
        with self._lock:
            stages, self._stages = list(self._stages.values()), {}
        for staged in stages:
            staged.drop()
