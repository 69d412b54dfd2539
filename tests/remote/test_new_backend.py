"""A remote backend added the way tierd/remote/registry.py says: one module
(its class and its open function) and one register() line, here made from
the test itself. The core learns nothing of it, and yet a session saved on
one node through an engine's memory is published into it and restored on
another node, byte-exact and checked, and a drop leaves nothing to resume."""

import threading

import pytest

from tests.helpers import SPEC, Harness, HostEngine, wait_for
from tierd.errors import FailedPrecondition, NotFound
from tierd.remote import registry
from tierd.remote.manifest import FIRST_VERSIONS, Head, made, owner_of
from tierd.types import SessionKey

# -- the backend's module: versions in a dict every "node" of this process reaches --

STORES: dict[str, dict] = {}


class ToyBackend:
    chunk_bytes = 1 << 16
    publish_window = 1 << 20

    def __init__(self, name: str) -> None:
        self.held = STORES.setdefault(name, {})  # key -> (version, Manifest or None, bytes)
        self.lock = threading.Lock()
        self.calls: list[str] = []

    def head(self, key):
        self.calls.append("head")
        version, m, _ = self.held.get(key, (0, None, b""))
        return m, version

    def current(self, key):
        return None  # (hears of no change: every read asks)

    def hears_changes(self):
        return False

    def replicated(self, keys):
        return [True] * len(keys)  # (one copy, in memory: as durable as it gets)

    def version_of(self, key):
        return self.head(key)[1]

    def heads(self, keys):
        return [Head.parse(m.encode()) if m is not None else None for m in (self.head(k)[0] for k in keys)]

    def tombstones(self, keys):
        return [v if m is None else 0 for v, m, _ in (self.held.get(k, (0, None, b"")) for k in keys)]

    def publish(self, key, expect, spec, fingerprint, num_tokens, page_bytes, checksums, token_hashes, data,
                coding=None):
        blob = b"".join(bytes(piece) for piece, _ in data)
        with self.lock:
            have = self.held.get(key, (0, None, b""))[0]
            if have != expect:
                raise FailedPrecondition(f"another node published version {have} of this session first",
                                         version=have)
            m = made(expect + 1 if expect else FIRST_VERSIONS, "toy", fingerprint, spec, num_tokens, len(blob),
                     page_bytes, checksums, token_hashes, owner_of(key), coding)
            self.held[key] = (m.version, m, blob)
        return m

    def read_into(self, key, manifest, claim):
        version, m, blob = self.held.get(key, (0, None, b""))
        if m is None or version != manifest.version:
            raise NotFound("gone")
        at = 0
        for start in range(0, len(blob), self.chunk_bytes):
            views = [memoryview(b).cast("B") for b in claim(min(self.chunk_bytes, len(blob) - start))]
            for v in views:
                v[:] = blob[at : at + v.nbytes]
                at += v.nbytes
            yield at

    def drop(self, key):
        with self.lock:
            version, m, _ = self.held.get(key, (0, None, b""))
            if m is None:
                return False
            self.held[key] = (version + 1, None, b"")
            return True

    def missing(self, versions):
        with self.lock:
            return [self.held.get(key, (0, None, b""))[0] == 0 for key, *_ in versions]

    def usage(self, tenant, session_id, recount=False):
        held = [(k, m) for k, (_, m, _) in self.held.items() if m is not None and k.tenant == tenant]
        return sum(m.nbytes for _, m in held), sum(m.nbytes for k, m in held if k.session_id == session_id)

    def listed(self, tenant, after="", count=100):
        return sorted(k.session_id for k, (_, m, _) in self.held.items()
                      if m is not None and k.tenant == tenant and k.session_id > after)[:count]

    def unlist(self, tenant, session_ids):
        pass

    def ping(self):
        pass

    def describe(self):
        return "a toy store"

    def close(self):
        pass


def open_toy(url, options):
    return ToyBackend(url.partition("://")[2])


registry.register("toy", __name__, "open_toy")

# -- the tests ----------------------------------------------------------------


@pytest.fixture
def nodes(tmp_path):
    made = []

    def node(name):
        h = Harness(str(tmp_path / name), remote="toy://shared")
        h.open()
        made.append(h)
        return h.store

    yield node
    for h in made:
        h.close()
    STORES.clear()


def test_a_backend_registered_from_outside_serves_a_save_on_one_node_and_a_restore_on_another(nodes):
    a, b = nodes("a"), nodes("b")
    key = SessionKey("alice", "chat")
    tokens = list(range(5000, 5040))
    src = HostEngine(seed=1)
    a.save(key, src.memory, SPEC, [3, 1, 4], 40, token_ids=tokens)
    wait_for(lambda: a.stat(key).remote_durable, what="the session published into the toy store")
    assert STORES["shared"][key][1].num_tokens == 40

    assert b.stat(key).tier == "remote" and b.lookup(key, tokens).num_tokens == 40
    dst = HostEngine(seed=2)
    assert b.restore(key, dst.memory, SPEC, [7, 8, 9]).num_tokens == 40
    assert dst.pages([7, 8, 9]) == src.pages([3, 1, 4])

    b.drop(key)
    with pytest.raises(NotFound):
        a.restore(key, dst.memory, SPEC, [7, 8, 9])  # dropped on b: a's copy goes too
