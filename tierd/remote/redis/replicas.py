"""Replicas: what a version waits for before it is remote-durable. Redis
replicates in the background, so a primary lost in a fail-over can take
writes it acknowledged with it; a write is on `count` replicas once WAIT
says so, on the connection that wrote it (WAIT waits for that connection's
writes alone). So the manifest's switch runs on the primary's own
connection, in one pipeline with WAIT and ROLE (how many replicas the
primary has connected: with fewer than `count`, all of them); and whether
what a primary took for a session is on its replicas now is asked with a
write of its own there (a key of the session's slot that expires at once),
then WAIT. Runs on the caller's thread (the publisher, the sweep).
"""

from __future__ import annotations

from typing import Any

from tierd.remote.redis.link import Link


class Moved(Exception):
    """The key's slot is served by another primary now (MOVED, ASK), or the
    primary the client knows of is gone: the cluster client finds the one now."""


class Replicas:
    def __init__(self, link: Link, count: int) -> None:
        self.link = link
        self.count = count  # replicas a write must be on (0: the primary's acknowledgement alone)
        # Replicas each primary had connected when last asked (ROLE): WAIT asks for no more (with none
        # connected, WAIT would hold the call for its whole timeout).
        self._connected: dict[tuple[Any, Any], int] = {}

    def replicated(self, barriers: list[str]) -> list[bool]:
        """For each barrier key (one of its session's slot), whether the
        primary that holds it has what it took until now on the replicas
        asked for; asked once per primary."""
        if self.count == 0:
            return [True] * len(barriers)
        by_primary: dict[tuple[Any, Any], bool] = {}
        out = []
        for barrier in barriers:
            where = _address(self.primary(barrier))
            if where not in by_primary:
                try:
                    _, acked = self.on_primary(barrier, "a replication check",
                                               lambda pipe, b=barrier: pipe.set(b, b"", px=1000))
                    by_primary[where] = self.enough(acked)
                except Moved:
                    by_primary[where] = False  # asked again later, on the primary the slot has then
            out.append(by_primary[where])
        return out

    def write(self, name: str, barrier: str, what: str, first: Any, plain: Any) -> tuple[list[Any], bool]:
        """A write (first(pipeline)) on the primary of key `name`, with WAIT:
        its replies, and whether the replicas asked for acknowledged it in
        time. Where the slot moved meanwhile, plain() through the cluster
        client instead (its one reply), and then a replication check of its
        own (barrier: a key of the same slot)."""
        try:
            replies, acked = self.on_primary(name, what, first)
            return replies, self.enough(acked)
        except Moved:
            return [plain()], self.replicated([barrier])[0]

    def enough(self, acked: tuple[int, int] | None) -> bool:
        """Whether (replicas that acknowledged, replicas connected) is what `count` asks for."""
        return self.count == 0 or acked is not None and acked[0] >= min(self.count, acked[1])

    def primary(self, name: str) -> Any:
        """A client of the primary that holds key `name` (as the cluster client last heard)."""
        from redis.cluster import RedisCluster

        client = self.link.client
        return client.get_node_from_key(name).redis_connection if isinstance(client, RedisCluster) else client

    def on_primary(self, name: str, what: str, first: Any) -> tuple[list[Any], tuple[int, int] | None]:
        """first(pipeline) on the primary of key `name`, then (with replicas
        asked for) WAIT and ROLE, in one pipeline on one connection: first's
        replies, and (replicas that acknowledged them, replicas the primary
        has connected); None without replicas asked for. Moved where the slot
        is elsewhere now."""
        import redis
        from redis.cluster import RedisCluster
        from redis.exceptions import AskError, MovedError

        primary = self.primary(name)
        where = _address(primary)
        wait = min(self.count, self._connected.get(where, self.count))
        pipe = primary.pipeline(transaction=False)
        first(pipe)
        if self.count:
            if wait:  # (half the call's timeout: the socket's read of the answer is bounded by all of it)
                pipe.execute_command("WAIT", wait, max(1, int((self.link.timeout or 0.5) * 500)))
            pipe.execute_command("ROLE")

        def execute() -> list[Any]:
            try:
                return pipe.execute()
            except (MovedError, AskError):
                raise Moved() from None
            except redis.ConnectionError:
                if not isinstance(self.link.client, RedisCluster):
                    raise
                raise Moved() from None  # a primary gone in a fail-over the client has not heard of yet

        replies = self.link.run(what, execute)
        if not self.count:
            return replies, None
        *own, role = replies
        acked = own.pop() if wait else 0
        connected = len(role[2]) if isinstance(role, list) and len(role) > 2 and isinstance(role[2], list) else 0
        self._connected[where] = connected
        return own, (int(acked), connected)


def _address(client: Any) -> tuple[Any, Any]:
    kw = client.connection_pool.connection_kwargs
    return kw.get("host"), kw.get("port")
