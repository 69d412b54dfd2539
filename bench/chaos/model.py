"""The expected state: what each session may hold, and the tally of every
check. Each session is written by one worker only, so its model needs no
guessing about order: the versions written (any may be served, a crash may
take back those not yet durable), the floor (the newest version the daemon
reported durable: nothing older may be served, and it may not vanish), and
whether it was dropped. Runs in the campaign's process, under one lock.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from bench.chaos.content import Label


@dataclass
class Key:
    tenant: str
    session: str
    written: dict[int, tuple[int, int]] = field(default_factory=dict)  # version -> (num_tokens, num_pages)
    next_version: int = 1
    floor: int = 0  # the newest version reported durable (0: none, or dropped since)
    floor_remote: bool = False  # ... and the remote tier's (any node, any local damage)
    floor_node: int = -1  # the node whose disk made it durable
    floor_damage: int = 0  # that node's damage count when it did
    dropped_at: int = 0  # the newest version written when a drop was acknowledged


@dataclass
class Tally:
    ops: Counter = field(default_factory=Counter)  # op -> acknowledged calls
    errors: Counter = field(default_factory=Counter)  # clean error class -> count
    samples: dict = field(default_factory=dict)  # (op, error class) -> the first message
    faults: Counter = field(default_factory=Counter)  # fault kind -> injected
    reads_checked: int = 0
    pages_checked: int = 0
    wrong_bytes: int = 0
    cross_tenant: int = 0
    durable_lost: int = 0
    final_checked: int = 0  # durable sessions asked for once every fault cleared
    unserved: int = 0  # durable sessions NOT_FOUND on a node that holds no copy while the remote tier was down
    resurrected: int = 0
    liveness: int = 0
    accounting: int = 0
    unexpected: int = 0  # errors no fault explains (INTERNAL, a Python exception in a reply)
    findings: list[str] = field(default_factory=list)

    started: float = field(default_factory=time.monotonic)

    def finding(self, what: str) -> None:
        if len(self.findings) < 200:
            self.findings.append(f"{time.monotonic() - self.started:7.1f} s: {what}")


class Model:
    def __init__(self, nodes: int) -> None:
        self.lock = threading.Lock()
        self.keys: dict[tuple[str, str], Key] = {}
        self.damage = [0] * nodes  # per node: how often its files were damaged
        self.tally = Tally()

    def key(self, tenant: str, session: str) -> Key:
        with self.lock:
            return self.keys.setdefault((tenant, session), Key(tenant, session))

    def new_version(self, k: Key, num_tokens_of, num_pages: int) -> int:
        with self.lock:
            v = k.next_version
            k.next_version += 1
            k.written[v] = (num_tokens_of(v), num_pages)
            return v

    def observed(self, k: Key, node: int, num_tokens: int, num_pages: int, durable: bool, remote: bool) -> None:
        """A reply (or stat) of a session that exists: its version, if the
        shape names one alone, becomes the floor when reported durable."""
        with self.lock:
            match = [v for v, shape in k.written.items() if shape == (num_tokens, num_pages)]
            if len(match) != 1 or not (durable or remote) or match[0] <= k.dropped_at:
                return
            v = match[0]
            if v > k.floor or (v == k.floor and remote and not k.floor_remote):
                k.floor, k.floor_remote = v, remote
                k.floor_node, k.floor_damage = node, self.damage[node]

    def dropping(self, k: Key, acknowledged: bool) -> None:
        with self.lock:
            k.floor, k.floor_remote = 0, False
            if acknowledged:
                k.dropped_at = max(k.written, default=0)

    def _binding(self, k: Key, node: int) -> int:
        """The floor a read on `node` must honour: a floor only a disk made
        is void on another node, and on its own once that disk was damaged."""
        if k.floor_remote:
            return k.floor
        if k.floor_node != node or self.damage[node] != k.floor_damage:
            return 0
        return k.floor

    def read(self, k: Key, node: int, labels: list[Label | None], shared: int = 0) -> int | None:
        """Check what a read of the session on `node` returned, page by page;
        the version it served (None: the bytes were wrong)."""
        t = self.tally
        with self.lock:
            t.reads_checked += 1
            t.pages_checked += len(labels)
            versions = set()
            for i, label in enumerate(labels):
                if label is None:
                    t.wrong_bytes += 1
                    t.finding(f"wrong bytes: {k.tenant}/{k.session} page {i} on node {node}")
                    return None
                if label.tenant != k.tenant:
                    t.cross_tenant += 1
                    t.finding(f"cross-tenant: {k.tenant}/{k.session} page {i} on node {node} holds {label}")
                    return None
                own = label.session == k.session and label.page == i
                family = i < shared and label.session.startswith("prefix-") and label.page == i
                if not (own or family):
                    t.wrong_bytes += 1
                    t.finding(f"wrong page: {k.tenant}/{k.session} page {i} on node {node} holds {label}")
                    return None
                if own:
                    versions.add(label.version)
            if len(versions) > 1:
                t.wrong_bytes += 1
                t.finding(f"mixed versions: {k.tenant}/{k.session} on node {node}: {sorted(versions)}")
                return None
            v = versions.pop() if versions else max(k.written, default=0)
            if v not in k.written:
                t.wrong_bytes += 1
                t.finding(f"a version never written: {k.tenant}/{k.session} v{v} on node {node}")
                return None
            if len(labels) != k.written[v][1]:
                t.wrong_bytes += 1
                t.finding(f"part of a version: {k.tenant}/{k.session} v{v} on node {node}: {len(labels)} pages of "
                          f"{k.written[v][1]}")
                return None
            floor = self._binding(k, node)
            if v < floor:
                t.durable_lost += 1
                t.finding(f"older than durable: {k.tenant}/{k.session} v{v} < v{floor} on node {node} "
                          f"({'remote' if k.floor_remote else f'disk of node {k.floor_node}'})")
            if k.dropped_at and v <= k.dropped_at:
                t.resurrected += 1
                t.finding(f"dropped but served: {k.tenant}/{k.session} v{v} on node {node}")
            return v

    def missing(self, k: Key, node: int, final: bool = False) -> None:
        """A read on `node` found no such session. Where only the remote tier
        holds it for that node, a node that finds the tier down says NOT_FOUND
        at once (docs/operations.md): counted as unserved, and the final
        check, once every fault has cleared, says whether it was lost."""
        with self.lock:
            floor = self._binding(k, node)
            if not floor:
                return
            if not final and k.floor_remote:
                self.tally.unserved += 1
                return
            self.tally.durable_lost += 1
            self.tally.finding(f"durable session gone: {k.tenant}/{k.session} v{floor} on node {node} "
                               f"({'remote' if k.floor_remote else f'disk of node {k.floor_node}'})")

    def durable(self) -> list[tuple[Key, int]]:
        """(session, node) for every floor that binds a node now."""
        with self.lock:
            return [(k, n) for k in self.keys.values() for n in range(len(self.damage)) if self._binding(k, n)]

    def version_of(self, k: Key, num_tokens: int, num_pages: int) -> int | None:
        with self.lock:
            match = [v for v, shape in k.written.items() if shape == (num_tokens, num_pages)]
            return match[0] if len(match) == 1 else None

    def older(self, k: Key, node: int, v: int) -> None:
        """A stat on `node` found version v: older than what binds there is a loss."""
        with self.lock:
            floor = self._binding(k, node)
            if v < floor:
                self.tally.durable_lost += 1
                self.tally.finding(f"older than durable at the end: {k.tenant}/{k.session} v{v} < v{floor} on node "
                                   f"{node}")
