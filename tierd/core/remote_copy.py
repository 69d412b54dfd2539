"""What a session knows of its copy in the remote tier and of its history
on this node: the fields core/store/remote.py and the publisher keep, a base
of model.Session. Metadata only; read and written under the store lock, on
whichever thread holds it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(eq=False, kw_only=True)
class RemoteCopy:
    """A base of model.Session (its methods read the session's snap)."""

    # The remote tier (core/store/remote.py): the manifest version this content builds on (0: none;
    # UNKNOWN: recovered from disk, the remote tier is asked before it is served) and that version's
    # write id ("": not known; after a publish lost in a fail-over, another node's publish may take the
    # same number), the snapshot version the remote tier holds (-1: none), and the
    # snapshot version of the last store from token 0 on this node (-1: none): past remote_at, a new
    # history that replaces what is there.
    remote_version: int = 0
    remote_write: str = ""
    remote_at: int = -1
    remote_fresh: int = -1
    remote_stored: int = 0  # bytes the remote version takes in the store (coded, or as it is)
    remote_codec: str = "none"  # the codec its pages are coded with there
    remote_error: float = 0.0  # the worst relative error of a page there (coded lossily)
    # The snapshot version of this node's last publish that the store took but did not yet hold as durably as
    # it promises (no replica acknowledged it in time; -1: none): remote-durable once it does.
    remote_unacked: int = -1
    # Whether the index names this row a history of this node's own (stored from token 0 here, not known to be in the
    # remote tier), the version its key held when a publish was tried (None: none), and durable writes deciding it now.
    own_row: bool = False
    own_expect: int | None = None
    own_writes: int = 0

    def own_begin(self) -> tuple[bool, int | None] | None:
        """With the store lock: a durable write starts; whether its row is a history of this node's own, and
        over what a publish of it was tried (None: it is not, and the index names none: nothing to record)."""
        self.own_writes += 1
        fresh = self.remote_fresh > self.remote_at
        return (fresh, self.own_expect) if fresh or self.own_row else None

    def own_end(self, own: tuple[bool, int | None] | None) -> None:
        """With the store lock: that write ended, committed (own: as own_begin said) or not (None)."""
        self.own_writes -= 1
        if own is not None:
            self.own_row = own[0]

    def remote_is(self, m: Any) -> None:
        """Record the remote version this content builds on: manifest m's."""
        self.remote_version, self.remote_write = m.version, m.write
        self.remote_stored, self.remote_codec = m.stored, m.codec
        self.remote_error = m.rel_error

    def remote_acked(self, version: int) -> bool:
        """The remote tier holds snapshot `version` as durably as it promises:
        whether that is the content now (remote-durable then)."""
        self.remote_unacked = -1
        if self.snap.version == version:
            self.remote_at = version
        return self.remote_at == version

    @property
    def remote_durable(self) -> bool:
        """The remote tier holds the current content."""
        return self.remote_at == self.snap.version

    @property
    def from_remote(self) -> bool:
        """Whether the content builds on a version the remote tier holds
        (fetched or published here, stores made since or not; or not known,
        recovered from disk), rather than on none or on a store from token 0
        made here since."""
        return self.remote_version != 0 and self.remote_fresh <= self.remote_at
