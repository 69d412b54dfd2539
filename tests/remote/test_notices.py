"""Change notices (tierd/remote/redis/notices.py) against a real Redis: a
version read, published or dropped is known without asking the store until
a notice of another arrives; a notice missed (a subscription stalled or
lost, a notice that does not parse, a store that sends none) never leaves a
version known as current past the lease or the recheck; a read that a
notice overtakes remembers nothing."""

import shutil
import time

import numpy as np
import pytest

from tests.helpers import wait_for
from tests.remote.proxies import StallingProxy
from tierd.checksum import page_checksum
from tierd.remote.redis import RemoteStore, connect
from tierd.remote.redis.notices import LEASE
from tierd.types import SessionKey

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (make install installs it)")
KEY = SessionKey("alice", "chat")


def publish(store, nbytes=1000, expect=0, key=KEY):
    """A version of one page of nbytes (its bytes: of that size's own)."""
    data = np.random.default_rng(nbytes).bytes(nbytes)
    return store.publish(key, expect, {"model_id": "m"}, "fp", 16, nbytes, np.array([page_checksum(data)],
                         dtype=np.uint64), np.arange(1, dtype=np.uint64), [(data, True)])


def as_known(m):
    return m.version, m.write


@pytest.fixture
def stores(cluster):
    """stores(n, recheck=...): n stores of one prefix over the cluster, each a node's; closed after."""
    prefix, made = f"n{time.monotonic_ns()}", []

    def make(n, recheck=60.0, url=None):
        for _ in range(n):
            made.append(RemoteStore(connect(url or cluster.url), prefix=prefix, recheck=recheck))
        for s in made[-n:]:
            wait_for(s.hears_changes, what="the notices live")
        return made[-n:]

    yield make
    for s in made:
        s.close()


def test_a_version_read_published_or_dropped_is_known_until_a_notice_of_another(stores):
    a, b = stores(2)
    assert b.current(KEY) is None  # nothing read yet
    m1 = publish(a)
    assert a.current(KEY) == as_known(m1)  # its own publish: known at once
    assert as_known(b.head(KEY)[0]) == b.current(KEY) == as_known(m1)  # a read: known from then on

    m2 = publish(a, 2000, expect=m1.version)
    wait_for(lambda: b.current(KEY) != as_known(m1), what="b hearing of version 2")
    assert b.current(KEY) is None and a.current(KEY) == as_known(m2)  # b forgot v1; it asks next time
    assert as_known(b.head(KEY)[0]) == b.current(KEY) == as_known(m2)

    assert b.drop(KEY) and b.current(KEY) is None
    wait_for(lambda: a.current(KEY) is None, what="a hearing of the drop")
    m, at = a.head(KEY)
    assert m is None and at > m2.version and a.current(KEY) == (at, "")  # the tombstone, known


def test_a_read_that_a_notice_of_another_version_overtakes_remembers_nothing(stores):
    a, b = stores(2)
    m1 = publish(a)
    name = b.link.key(KEY, "m")
    with b.notices.watching(name) as seen:
        found = as_known(b.reader.head(KEY)[0])  # what a read found: version 1 ...
        m2 = publish(a, 2000, expect=m1.version)  # ... and a publish after it, before the read is done
        wait_for(lambda: seen.heard, what="the notice of version 2, heard while the read runs")
        seen.found = found
    assert b.current(KEY) is None  # not taken for current: version 2 is
    assert as_known(b.head(KEY)[0]) == b.current(KEY) == as_known(m2)
    with b.notices.watching(name) as seen:  # a notice of the very version read overtakes nothing
        seen.found = as_known(b.reader.head(KEY)[0])
        b.notices.heard(f"{name} {m2.version} {m2.write}".encode())
    assert b.current(KEY) == as_known(m2)


def test_a_notice_that_does_not_parse_forgets_everything_and_one_of_no_session_nothing(stores):
    a, b = stores(2)
    other = SessionKey("alice", "other")
    m, o = publish(a), publish(a, key=other)
    b.head(KEY)
    b.head(other)
    # a notice of a key no session has, on the primary of the other session, whose notice follows it there
    node = b.link.client.get_node_from_key(b.link.key(other, "m"))
    node.redis_connection.publish(b.notices.channel, f"{b.prefix}:nobody 0 -")
    publish(a, 2000, expect=o.version, key=other)
    wait_for(lambda: b.current(other) is None, what="b hearing of the other session's version 2")
    assert b.current(KEY) == as_known(m)  # the notice before it named no session: nothing forgotten
    b.link.client.publish(b.notices.channel, "garbage")
    wait_for(lambda: b.current(KEY) is None, what="b forgetting what it knew")
    wait_for(b.hears_changes, what="the notices live again")
    assert as_known(b.head(KEY)[0]) == b.current(KEY) == as_known(m)


def test_a_node_the_store_lets_not_publish_notices_still_publishes_and_others_ask_once_the_recheck_ends(
        single_server, caplog):
    """A store whose ACL lets a node not publish (Redis 7 gives a new user
    no channel): that node publishes and drops without notices, and hears
    none; a node that knew the version before trusts it `recheck` seconds
    at most, then asks."""
    url = f"redis://127.0.0.1:{single_server}"
    connect(url).execute_command("ACL", "SETUSER", "quiet", "on", ">pw", "~*", "+@all", "resetchannels")
    b = RemoteStore(connect(url), prefix="q", recheck=1.0)
    quiet = RemoteStore(connect(f"redis://quiet@127.0.0.1:{single_server}", password="pw"), prefix="q", recheck=60)
    try:
        wait_for(b.hears_changes, what="b's notices live")
        m1 = publish(quiet)
        assert "refuses this node's change notices" in caplog.text
        assert as_known(b.head(KEY)[0]) == b.current(KEY) == as_known(m1)
        m2 = publish(quiet, 2000, expect=m1.version)  # no notice: b trusts version 1 ...
        wait_for(lambda: b.current(KEY) is None, what="b asking again")  # ... for its recheck at most
        assert as_known(b.head(KEY)[0]) == as_known(m2)
        assert quiet.current(KEY) is None and not quiet.hears_changes()  # its subscriptions are refused too
        assert as_known(quiet.head(KEY)[0]) == as_known(m2)
    finally:
        quiet.close()
        b.close()


def test_a_stalled_subscription_vouches_for_nothing_past_the_lease_and_a_lost_one_forgets_everything(
        single_server):
    proxy = StallingProxy(single_server)
    url = f"redis://127.0.0.1:{single_server}"
    a = RemoteStore(connect(url), prefix="s", recheck=60)
    b = RemoteStore(connect(f"redis://127.0.0.1:{proxy.port}"), prefix="s", recheck=60)
    try:
        wait_for(lambda: a.hears_changes() and b.hears_changes(), what="the notices live")
        m1 = publish(a)
        assert as_known(b.head(KEY)[0]) == b.current(KEY) == as_known(m1)
        t0 = time.monotonic()
        proxy.flowing.clear()  # b's notices and heartbeats held back ...
        m2 = publish(a, 2000, expect=m1.version)  # ... so b does not hear of version 2
        # Each answered heartbeat vouches for LEASE seconds from when it was sent (before t0): past that,
        # nothing is taken for current, whatever b's threads are doing.
        wait_for(lambda: time.monotonic() > t0 + LEASE + 0.05, what="the lease run out")
        assert b.current(KEY) is None and not b.hears_changes()
        assert as_known(b.head(KEY)[0]) == as_known(m2) and b.current(KEY) is None  # asked, and not remembered
        proxy.flowing.set()
        wait_for(b.hears_changes, what="b subscribed again")
        assert b.current(KEY) is None  # what it knew before is forgotten
        assert as_known(b.head(KEY)[0]) == b.current(KEY) == as_known(m2)

        connect(url).client_kill_filter(_type="pubsub")  # every subscription lost
        wait_for(lambda: b.current(KEY) is None, what="b forgetting what it knew")
        wait_for(lambda: a.hears_changes() and b.hears_changes(), what="the notices live again")
        m3 = publish(a, 3000, expect=m2.version)
        assert as_known(b.head(KEY)[0]) == b.current(KEY) == as_known(m3)
    finally:
        b.close()
        a.close()
        proxy.close()


def test_a_store_that_refuses_notices_at_run_time_takes_every_publish_and_drop_whole(single_server):
    """Regression: the switch set the manifest, then failed at its notice
    (the ACL changed at run time), so the publish was reported failed and
    its chunks deleted under a manifest that named them; a drop failed too,
    its tombstone set."""
    url = f"redis://127.0.0.1:{single_server}"
    a = RemoteStore(connect(url), prefix="r", recheck=1.0)
    b = RemoteStore(connect(url), prefix="r", recheck=1.0)
    try:
        m1 = publish(a)
        connect(url).execute_command("ACL", "SETUSER", "default", "-publish")
        m2 = publish(a, 2000, expect=m1.version)  # taken, with no notice
        m, _ = b.head(KEY)
        assert as_known(m) == as_known(m2) and b"".join(b.read(KEY, m)) == np.random.default_rng(2000).bytes(2000)
        assert a.drop(KEY) and b.head(KEY)[0] is None
    finally:
        connect(url).execute_command("ACL", "SETUSER", "default", "+publish")
        a.close()
        b.close()
