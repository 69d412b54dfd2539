"""What operators and tests look at: Stat, List and Stats (read under the store
lock, counted without it), where a session's pages lie, and, for tests and
benches, the integrity scan of the durable tier and the accounting
invariant. Any thread."""

from __future__ import annotations

import bisect
import time

from tierd.core.index import DiskIndex
from tierd.core.move_queue import MoveQueue
from tierd.core.placement import Placement
from tierd.core.roles import TierRoles
from tierd.core.store.describe import Describe
from tierd.core.store.leases import Leases
from tierd.core.store.table import SessionTable
from tierd.core.store.upkeep import CHECKS_PER_LOCK
from tierd.errors import DataLoss, InvalidArgument, shown
from tierd.tiers import tier_rank
from tierd.tiers.allocator import Piece
from tierd.tiers.ioqueue import IOClass
from tierd.policy import SessionView
from tierd.transfer.copier import CopyEngine
from tierd.types import SessionInfo, SessionKey, TierStats


class Inspection:
    def __init__(self, table: SessionTable, describe: Describe, placement: Placement, leases: Leases,
                 moves: MoveQueue, index: DiskIndex | None, copier: CopyEngine, tiers: dict, roles: TierRoles) -> None:
        self.table = table
        self.describe = describe
        self.placement = placement
        self.leases = leases
        self.moves = moves
        self.index = index
        self.copier = copier
        self.tiers = tiers
        self.roles = roles

    def stat(self, key: SessionKey) -> SessionInfo:
        session = self.table.get(key)
        with self.table.lock:
            return self.describe.info(session)

    def policy_view(self, key: SessionKey) -> SessionView:
        """What policy knows of the session now (its idle clock, whether it is awaited, busy, ...)."""
        session = self.table.get(key)
        busy = self.moves.busy_keys()
        with self.table.lock:
            return self.describe.view(session, busy)

    def list(self, tenant: str | None = None, after: str = "", limit: int = 100) -> tuple[list[SessionInfo], str]:
        """Sessions ordered by (tenant, id), after the page token; returns the
        page and the token of the next page ("" when done)."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 10_000:
            raise InvalidArgument(f"limit must be 1 to 10000, got {shown(limit)}", field="limit")
        keys = sorted(self.table.keys(tenant))  # described without the store lock, in batches
        if after:
            keys = keys[bisect.bisect_right(keys, tuple(after.split("\x00", 1))):]
        page: list[SessionInfo] = []
        for i in range(0, min(limit, len(keys)), CHECKS_PER_LOCK):
            with self.table.lock:
                page += [self.describe.info(s) for k in keys[i : min(i + CHECKS_PER_LOCK, limit)]
                         if (s := self.table.find(k)) is not None]
            time.sleep(0)  # let the event loop have the GIL between batches (~4 ms each)
        token = "\x00".join(keys[limit - 1]) if len(keys) > limit else ""
        return page, token

    def stats(self, tenant: str | None = None) -> list[TierStats]:
        """Each tier's budget, bytes used, capacity and sessions holding pages
        there: the whole daemon's, or only what `tenant` holds (its capacity,
        the bytes the tier has mapped for every tenant, is 0)."""
        sessions = self.table.sessions()
        # Counted without the store lock (a scrape took it for ~20 ms at 20,000
        # sessions): tiers_held() reads each placement by name, never iterating a
        # dict that a move may change meanwhile.
        counts = {t: 0 for t in self.tiers}
        saved = {t: 0 if tenant is not None else self.placement.held.shared_bytes.get(t, 0) for t in self.tiers}
        holders = self.placement.held.holders
        for s in sessions:
            if tenant is None or s.key.tenant == tenant:
                for t in s.snap.tiers_held():
                    counts[t] += 1
            # An allocation the state kept for a store (Session.kept) holds beside the content saves nothing.
            joint = self.describe.joint(s)
            if tenant is None and joint:
                saved[self.placement.durable] -= sum(p.alloc_bytes for p in s.kept if p.offset in joint)
            elif s.key.tenant == tenant:  # each holder's part of what its shared allocations save
                for t in self.tiers:
                    kept = [p for p in s.kept if p.offset not in joint] if t == self.placement.durable else []
                    saved[t] += sum(p.alloc_bytes - p.alloc_bytes // n for p in s.snap.pieces(t) + kept
                                    if (n := holders(t, p) - (t == self.placement.durable and p.offset in joint)) > 1)
        return [TierStats(name, t.budget, t.used if tenant is None else t.used_by(tenant),
                          t.capacity if tenant is None else 0, counts[name], t.backend, saved[name])
                for name, t in sorted(self.tiers.items(), key=lambda kv: tier_rank(kv[0]))]

    def scan(self) -> list[str]:
        """An integrity scan of the durable tier (disk): every committed page reads back
        with its checksum, pieces lie inside the slabs and never overlap, the
        index holds exactly the pieces in memory, and the accounting holds
        (check_accounting). Returns the problems."""
        problems: list[str] = []
        if self.index is None:
            return problems
        durable = self.placement.durable
        disk = self.tiers[durable]
        extents = []
        seen: set[int] = set()
        indexed_pieces = 0
        for key in self.table.keys():
            with self.table.held(key) as session:
                snap = session.snap
                pieces = snap.pieces(durable)
                # (A state kept for a store: the index holds it instead; it shares allocations with the content.)
                held = {p.offset: p for p in pieces + session.kept}.values()
                extents += [(p.offset, p.alloc_bytes, key) for p in held if p.offset not in seen]
                seen.update(p.offset for p in held)  # an allocation of shared prefix pages: once
                indexed_pieces += len(session.kept or pieces)
                spans = snap.spans(durable)
                try:
                    for _ in self.copier.windows(spans, snap.geometry, snap.checksums, IOClass.WRITEBACK):
                        pass
                except (DataLoss, OSError) as exc:
                    problems.append(f"{key.tenant}/{key.session_id}: {exc}")
        extents.sort()
        for (a, n, k1), (b, _, k2) in zip(extents, extents[1:]):
            if a + disk.allocator.round(n) > b:
                problems.append(f"{k1.session_id} and {k2.session_id} overlap at byte {b}")
        if extents and extents[-1][0] + extents[-1][1] > disk.capacity:
            problems.append("a piece lies past the end of the slab files")
        indexed = self.index.count()[1]
        if indexed != indexed_pieces:
            problems.append(f"the index holds {indexed} pieces, the sessions {indexed_pieces}")
        return problems + self.check_accounting()

    def check_accounting(self) -> list[str]:
        """The accounting invariant: in every tier, the bytes its allocator
        holds, in all and per tenant, are the bytes of the allocations held
        by the sessions' pieces and the open save leases (an allocation that
        several hold, shared prefix pages, once), rounded as the allocator
        rounds; and each allocation has as many holders as its count says.
        Returns the differences; exact only while no call or move is in flight."""
        held: dict[str, dict[str, int]] = {name: {} for name in self.tiers}
        refs: dict[tuple[str, int], int] = {}
        writes = self.leases.open_writes()
        with self.table.lock:
            sessions = self.table.sessions()
            holders = [(s.key.tenant, s.snap.placement) for s in sessions]
            holders += [(s.key.tenant, {self.placement.durable: s.kept}) for s in sessions if s.kept]
            holders += [(w.key.tenant, {w.tier: w.pieces}) for w in writes] + [(w.key.tenant, w.lent) for w in writes]
            holders += [(s.key.tenant, {tier: [p]}) for s in sessions for tier, p in s.deferred]
            for tenant, placement in holders:
                for tier, pieces in placement.items():
                    for p in pieces:
                        key = (tier, p.offset)
                        refs[key] = refs.get(key, 0) + 1
                        if refs[key] == 1:
                            held[tier][tenant] = held[tier].get(tenant, 0) + self.tiers[tier].allocator.round(
                                p.alloc_bytes)
            counted = {key: self.placement.held.holders(key[0], Piece(key[1], 0, 0, 0)) for key in refs}
            stray = [key for key in self.placement.held.shared_allocations() if key not in refs]
        problems = [f"the {tier} tier's allocation at {offset} has {n} holders, its count says {counted[tier, offset]}"
                    for (tier, offset), n in sorted(refs.items()) if counted[tier, offset] != n]
        problems += [f"the {tier} tier's allocation at {offset} is counted as shared, and nothing holds it"
                     for tier, offset in stray]
        for name, tier in self.tiers.items():
            if tier.used - tier.unusable != sum(held[name].values()):  # (unusable: retired after a fault)
                problems.append(f"the {name} tier's allocator holds {tier.used - tier.unusable} bytes, its sessions "
                                "and leases "
                                f"{sum(held[name].values())}")
            problems += [f"the {name} tier accounts {tier.used_by(tenant)} bytes to tenant {tenant!r}, its sessions "
                         f"and leases hold {nbytes}" for tenant, nbytes in sorted(held[name].items())
                         if tier.used_by(tenant) != nbytes]
        return problems
