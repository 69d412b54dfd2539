"""SnapshotReader: the chunks of a Get, read with no lock held; the pages
it reads stay allocated until it is exhausted or closed. Iterated on the
event loop's stream or any thread; closed from any."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator


class SnapshotReader(Iterator[bytes | memoryview]):
    """Chunks of a snapshot (bytes, or memoryviews valid until the next
    chunk). Until it is exhausted or closed, the pages it reads stay
    allocated; close() may come from any thread, also while another thread
    is taking a chunk (it then waits for that chunk). `digest` is the XXH3 of
    the chunk last returned where the store knew it (a whole page's stored
    checksum), else 0."""

    def __init__(self, chunks: Iterator[tuple[bytes | memoryview, int]], done: Callable[[], None]) -> None:
        self._chunks = chunks
        self._done = done
        self._open = True
        self._lock = threading.Lock()
        self.digest = 0

    def __next__(self) -> bytes | memoryview:
        with self._lock:
            if not self._open:
                raise StopIteration
            try:
                data, self.digest = next(self._chunks)
                return data
            except BaseException:
                self._close()
                raise

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._open:
            self._open = False
            try:
                self._chunks.close()  # type: ignore[attr-defined]
            finally:
                self._done()
