"""llama-server, unmodified, with tierd holding its conversations: an HTTP
front that speaks llama-server's API in front of one or more llama-server
processes and moves each slot's state in and out through tierd, so more
conversations than slots each resume from tierd when they come back.

    llama-server -m model.gguf -np 2 --cache-ram 0 --slot-save-path /dev/shm/tierd-slots --port 8080
    tierd llama-front --upstream http://127.0.0.1:8080 --slot-dir /dev/shm/tierd-slots --port 8090

A request names its conversation with the header X-Tierd-Session; the
completion calls (llamaserver_http: native and OpenAI-compatible) are
routed to a slot: the one that holds the conversation, else a free one,
else the one used least lately. Into a slot that does not hold it, the
conversation's stored state is set before the request goes on (llama-server's
slot restore, of a name in the slot directory linked to the shared memory of
the restore lease the daemon lends, read by llama-server as it is, the lease
held until it has read it); after each turn the slot's state is stored again (llama-server
writes its slot file, the front reads it into a save lease), so a
conversation taken out of its slot, a restart of llama-server or of tierd,
loses nothing stored. A request that names no conversation is served in a
slot as llama-server would serve it, and nothing of it is stored.

A slot is trusted to still hold its conversation only where llama-server's
/slots says so (the task and the tokens the front saw last); else the state
is set again. What a restore gave is read from llama-server's own counts
(the timings' cache_n: prompt tokens not decoded again): a restore after
which none was reused (or a BOS alone) is a miss, counted and logged with the model's kind
(llamacpp_state.gguf_kind), never a hit; so are a state of another identity
(the GGUF's fingerprint, llama-server's build, the operator's --kv-settings),
a damaged state (dropped), one llama-server refused, or tierd unreachable:
the turn is then decoded as without tierd. A turn tierd cannot store
stands; the slot is stored again before another conversation takes it.

Prefetch: a request for a conversation no slot holds has its state staged
(a restore lease, begun on a thread of its own, and its name in the slot
directory) while it waits for a slot; POST
/tierd/prefetch {"session": NAME} stages one on a hint. GET /tierd/stats
gives the counts. Runs in its own process: a thread per HTTP connection,
and the staging threads."""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

from tierd.adapters.llamacpp_state import Counts
from tierd.adapters.llamaserver_http import SESSION_HEADER, FrontError, auth, relay
from tierd.adapters.llamaserver_upstream import Slot, Stages, Upstream, check_slot_dir, read_into, unlink
from tierd.adapters.staged import save_opaque
from tierd.client import Arena, Client, DataLoss, IdentityMismatch, KVSpec, NotFound, TierdError

log = logging.getLogger("tierd.llamaserver")

NO_REUSE = 1  # tokens reused of a restore that count as none: a BOS, which every prompt shares
NAME = re.compile(r"[A-Za-z0-9_:@+=~][A-Za-z0-9._:@+=~-]{0,199}")


@dataclass
class FrontCounts(Counts):
    """Counts, and the turns served from a slot that still held the conversation."""

    hot: int = 0
    turns: int = 0


class Front:
    """The slots, the conversations in them, and the moves through tierd."""

    def __init__(self, upstreams: list[Upstream], slot_dir: str, client: Client, namespace: str = "llama-server",
                 wait_slot: float = 300.0) -> None:
        self.upstreams, self.client, self.namespace, self.wait_slot = upstreams, client, namespace, wait_slot
        self.slot_dir = check_slot_dir(slot_dir)
        if not NAME.fullmatch(namespace) or ".." in namespace:
            raise ValueError(f"a namespace is letters, digits and ._:@+=~-, got {namespace!r}")
        self.slots = [Slot(u, i, os.path.join(self.slot_dir, f"tierd-{n}-{i}.bin"))
                      for n, u in enumerate(upstreams) for i in range(u.slots)]
        for name in os.listdir(self.slot_dir):  # states a front that was killed left placed (links to leases)
            if name.startswith("tierd-"):
                unlink(os.path.join(self.slot_dir, name))
        self.arena = Arena()
        self._arena_lock = threading.Lock()
        self._cond = threading.Condition()
        self.stages = Stages(client, self.slot_dir, self._mapped, self.arena.shm_dir)
        self.counts = FrontCounts()
        self._counts_lock = threading.Lock()

    def session_of(self, name: str | None) -> str | None:
        if name is None:
            return None
        if not NAME.fullmatch(name) or ".." in name:
            raise FrontError(400, f"{SESSION_HEADER} is 1-200 characters of letters, digits and ._:@+=~-, "
                                  f"not starting with '.' or '-' and without '..'")
        return f"{self.namespace}-{name}"

    def complete(self, handler: BaseHTTPRequestHandler, path: str, body: dict[str, Any], sid: str | None) -> None:
        """One completion call: a slot for the conversation, its state set,
        the call relayed, the slot's state stored after."""
        if sid is not None:
            self.prefetch(sid)  # staged while the request waits for a slot
        slot = self._acquire(sid)
        try:
            restored = self._prepare(slot, sid)
            body = dict(body, id_slot=slot.id, cache_prompt=True)
            timings = relay(handler, slot.upstream, "POST", path, json.dumps(body).encode(),
                            {"Content-Type": "application/json"} | auth(handler))
            slot.session = sid
            reused = int(timings.get("cache_n") or 0) if timings is not None else 0
            with self._counts_lock:
                self.counts.turns += 1
                if restored and timings is not None:
                    self.counts.reused_tokens += reused
                    self.counts.restores -= 1 if reused <= NO_REUSE else 0
            if restored and timings is not None and reused <= NO_REUSE:
                self._miss("no reuse", sid, slot, f"{restored} tokens were set, and llama-server reused {reused} "
                                                  "of them", slot.upstream.kind)
            if sid is not None:
                self._store(slot, sid)
        finally:
            self._release(slot)

    def _acquire(self, sid: str | None) -> Slot:
        deadline = time.monotonic() + self.wait_slot
        with self._cond:
            while True:
                held = [s for s in self.slots if sid is not None and sid in (s.session, s.serving)]
                if held and not any(s.busy for s in held):
                    slot = held[0]
                elif not held:
                    free = [s for s in self.slots if not s.busy]
                    slot = min(free, key=lambda s: (s.session is not None, s.used)) if free else None
                else:
                    slot = None  # the conversation's own turn before it is still running: after it
                if slot is not None:
                    slot.busy, slot.serving = True, sid
                    return slot
                if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                    raise FrontError(503, f"no slot came free in {self.wait_slot:g} s")

    def _release(self, slot: Slot) -> None:
        with self._cond:
            slot.busy, slot.serving, slot.used = False, None, time.monotonic()
            self._cond.notify_all()

    def _prepare(self, slot: Slot, sid: str | None) -> int:
        """Make the slot hold the conversation's stored state; returns the
        tokens set (0: none, or the slot held it already)."""
        if sid is not None and slot.session == sid:
            view = slot.upstream.slot_view(slot.id)
            if view is not None and view.get("id_task") == slot.task and view.get("n_prompt_tokens") == slot.tokens:
                self.stages.drop(sid)
                with self._counts_lock:
                    self.counts.hot += 1
                return 0
            slot.session = None  # llama-server restarted, or another call took the slot: set it again
        if slot.dirty and slot.session is not None:
            self._store(slot, slot.session)  # its last turn, stored before another takes the slot
        slot.session, slot.dirty = None, False
        return 0 if sid is None else self._restore(slot, sid)

    def _restore(self, slot: Slot, sid: str) -> int:
        try:
            spec, kind = slot.upstream.spec()
        except OSError as exc:
            raise FrontError(502, f"llama-server at {slot.upstream.url}: {exc}") from None
        try:
            file, end = self.stages.state_file(sid, spec, slot.file)
        except NotFound:
            return 0  # a conversation tierd does not hold: its first turn
        except IdentityMismatch as exc:
            return self._miss("another model", sid, slot, str(exc), kind)
        except DataLoss as exc:  # damaged: never set into llama-server, and dropped
            self._forget(sid)
            return self._miss("damaged", sid, slot, str(exc), kind)
        except TierdError as exc:  # tierd unreachable, say: the turn is decoded as without it
            return self._miss(type(exc).__name__, sid, slot, str(exc), kind)
        try:
            status, answer = slot.upstream.call("POST", f"/slots/{slot.id}?action=restore",
                                                {"filename": os.path.basename(file)})
        finally:
            unlink(file)
            in_time = end()
        if not in_time:  # read past the lease's time: what was read may have been another's
            slot.upstream.call("POST", f"/slots/{slot.id}?action=erase")
            return self._miss("late", sid, slot, "the state was read after its lease's deadline", kind)
        if status != 200 or not isinstance(answer, dict):
            message = answer.get("error", {}).get("message") if isinstance(answer, dict) else None
            return self._miss("refused", sid, slot, f"llama-server answered {status}: {message}", kind)
        try:
            same = slot.upstream.spec()[0] == spec
        except OSError:
            same = False
        if not same:  # llama-server restarted with another model meanwhile: the state is not used
            slot.upstream.call("POST", f"/slots/{slot.id}?action=erase")
            return self._miss("another model", sid, slot, "llama-server's model changed during the restore", kind)
        tokens = int(answer.get("n_restored") or 0)
        with self._counts_lock:
            self.counts.restores += 1
            self.counts.restored_bytes += int(answer.get("n_read") or 0)
        return tokens

    def _store(self, slot: Slot, sid: str) -> None:
        """llama-server writes the slot's state into its file; the file is
        read into a save lease and committed as the conversation's session."""
        slot.dirty = True
        self.stages.drop(sid)  # a state staged before this turn is not the conversation's any more
        unlink(slot.file)  # (llama-server writes a file of its own, never through a link)
        try:
            status, answer = slot.upstream.call("POST", f"/slots/{slot.id}?action=save", {"filename": slot.filename})
            if status != 200 or not isinstance(answer, dict) or not answer.get("n_saved"):
                raise ConnectionError(f"llama-server answered the slot's save with {status}: {answer}")
            tokens = int(answer["n_saved"])
            spec, _ = slot.upstream.spec()
            size = self._read_file(slot, sid, spec, tokens)
            view = slot.upstream.slot_view(slot.id)
        except (OSError, TierdError) as exc:  # tierd is a cache: the turn stands, unstored
            with self._counts_lock:
                self.counts.save_failures += 1
            log.warning("llama-server slot %d of %s: conversation %s not stored: %s", slot.id, slot.upstream.url,
                        sid, exc)
            return
        finally:
            unlink(slot.file)
        slot.session, slot.tokens, slot.dirty = sid, tokens, False
        slot.task = view.get("id_task") if view is not None else None
        with self._counts_lock:
            self.counts.saves += 1
            self.counts.saved_bytes += size

    def _mapped(self, lease: Any) -> Any:
        """The lease's memory, mapped here (uint8): one segment, its pages back to back."""
        with self._arena_lock:
            [(_, rows)] = self.arena.runs(lease)
        return rows.reshape(-1)

    def _read_file(self, slot: Slot, sid: str, spec: KVSpec, tokens: int) -> int:
        """The slot file llama-server wrote, read straight into a save lease, committed."""
        size = os.stat(slot.file, follow_symlinks=False).st_size
        save_opaque(self.client, sid, spec, tokens, size,
                    lambda lease: read_into(slot.file, memoryview(self._mapped(lease))[:size]))
        return size

    def prefetch(self, sid: str) -> None:
        """Stage the conversation's state (module docstring), unless a slot holds it."""
        if any(s.session == sid for s in self.slots):
            return
        try:
            spec, _ = self.upstreams[0].spec()
        except OSError:
            return  # llama-server down: the request that follows says so
        self.stages.begin(sid, spec)

    def _miss(self, reason: str, sid: str, slot: Slot, detail: str, kind: str) -> int:
        with self._counts_lock:
            self.counts.misses += 1
            self.counts.miss_reasons[reason] = self.counts.miss_reasons.get(reason, 0) + 1
        log.warning("llama-server restore miss (%s model): %s: conversation %s, slot %d of %s: %s", kind, reason,
                    sid, slot.id, slot.upstream.url, detail)
        return 0

    def _forget(self, sid: str) -> None:
        try:
            self.client.drop(sid)
        except TierdError:
            pass  # gone already, or tierd unreachable: the session stays until it is evicted

    def stats(self) -> dict[str, Any]:
        with self._counts_lock:
            out = asdict(self.counts)
        out["slots"] = [{"upstream": s.upstream.url, "id": s.id, "session": s.session, "tokens": s.tokens,
                         "busy": s.busy} for s in self.slots]
        out["staged"] = self.stages.ready()
        return out

    def close(self) -> None:
        self.stages.close()
        self.arena.close()


