"""The session an engine request belongs to: its id under its cache salt."""

from tierd.adapters.sessions import session_key
from tierd.core.store import check_id


def test_the_same_id_under_another_salt_is_another_session():
    # two users of one vLLM server send the same X-Session-ID with their own cache_salt
    alice, bob = session_key("chat-1", "salt-of-alice"), session_key("chat-1", "salt-of-bob")
    assert alice != bob
    assert session_key("chat-1", "salt-of-alice") == alice  # stable across requests and processes
    assert session_key("chat-1") == session_key("chat-1", "") == "chat-1"  # no salt: the id itself
    assert alice.startswith("chat-1~") and alice != "chat-1"


def test_salted_keys_are_valid_ids_and_do_not_collide_by_concatenation():
    long_id = "s" * 256
    key = session_key(long_id, "x")
    assert check_id("session_id", key) == key and len(key) <= 256
    assert session_key("ab", "c") != session_key("a", "bc")  # salt and id are length-prefixed
    assert session_key(long_id, "x") != session_key(long_id[:-1] + "t", "x")  # beyond the kept prefix too
