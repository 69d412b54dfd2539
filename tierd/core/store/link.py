"""RemoteLink: the store's calls on the remote tier's backend, and whether
the tier is down. A call the backend does not answer (Unavailable) marks
it down; until a probe finds every primary answering again (every
PROBE_SECONDS), every call fails at once, so nothing waits on a store that
does not answer, and on_up is told when it answers. A call the store
refuses (Refused: it answered, with an error) fails alone. Runs on the
caller's thread; the probe on a thread of its own while the tier is down.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from tierd.core.events import StoreEvents
from tierd.errors import Unavailable
from tierd.remote.backend import Refused, RemoteBackend

log = logging.getLogger("tierd.core.store")

PROBE_SECONDS = 1.0  # between probes of a remote tier that is down


class RemoteLink:
    def __init__(self, backend: RemoteBackend, events: StoreEvents, on_up: Callable[[], None]) -> None:
        self.backend = backend
        self.events = events
        self.down = threading.Event()  # set while the remote tier is down (the probe clears it)
        self._on_up = on_up
        self._lock = threading.Lock()
        self._closed = False

    def call(self, what: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """fn(*args, **kw), a call on the backend, failing at once while the tier is down."""
        if self.down.is_set():
            raise Unavailable("the remote tier is unreachable (a probe retries it every second)")
        try:
            return fn(*args, **kw)
        except Refused:
            self.events.remote_op(what, "refused")
            raise
        except Unavailable:
            self.went_down(what)
            raise

    def went_down(self, what: str) -> None:
        """Mark the remote tier down (`what` failed) and start the probe that brings it back."""
        self.events.remote_op(what, "unavailable")
        with self._lock:
            if self.down.is_set() or self._closed:
                return
            self.down.set()
        log.warning("remote tier: %s failed; until it answers again, sessions not held here are not found", what)
        self.events.remote_up(False)
        threading.Thread(target=self._probe, name="tierd-remote-probe", daemon=True).start()

    def _probe(self) -> None:
        while not self._closed:
            time.sleep(PROBE_SECONDS)
            try:
                self.backend.ping()
            except Unavailable:
                continue
            self.down.clear()
            log.warning("remote tier: answering again")
            self.events.remote_up(True)
            self._on_up()
            return

    def close(self) -> None:
        """Stop probing and close the backend's connections (once nothing uses them)."""
        self._closed = True
        self.backend.close()
