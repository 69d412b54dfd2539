"""The store's components as build.py hands them to the facade (store.py).
Plain data: any thread."""

from __future__ import annotations

from dataclasses import dataclass

from tierd.core.move_queue import MoveQueue
from tierd.core.placement import Placement
from tierd.core.roles import TierRoles
from tierd.core.store.describe import Describe
from tierd.core.store.fetcher import Fetcher
from tierd.core.store.finder import Finder
from tierd.core.store.inspection import Inspection
from tierd.core.store.leases import Leases
from tierd.core.store.lifecycle import Lifecycle
from tierd.core.store.link import RemoteLink
from tierd.core.store.publisher import Publisher
from tierd.core.store.reads import Reader
from tierd.core.store.remote import PublishQueue, Remote
from tierd.core.store.remote_calls import RemoteCalls
from tierd.core.store.sharing import Sharing
from tierd.core.store.stores import Saves
from tierd.core.store.sweeper import Sweeper
from tierd.core.store.table import SessionTable
from tierd.core.store.upkeep import Upkeep
from tierd.core.store.writes import Writer


@dataclass(frozen=True)
class RemoteParts:
    """The remote tier's components, where there is one."""

    remote: Remote
    link: RemoteLink
    queue: PublishQueue
    finder: Finder
    fetcher: Fetcher
    publisher: Publisher
    sweeper: Sweeper
    calls: RemoteCalls


@dataclass(frozen=True)
class Parts:
    tiers: dict
    roles: TierRoles
    table: SessionTable
    sharing: Sharing
    describe: Describe
    placement: Placement
    writer: Writer
    saves: Saves
    reader: Reader
    leases: Leases
    lifecycle: Lifecycle
    upkeep: Upkeep
    inspection: Inspection
    moves: MoveQueue
    remote: RemoteParts | None
