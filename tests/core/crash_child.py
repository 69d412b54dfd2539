"""Child process for the crash test: saves, appends, demotes and drops in a
loop, announcing each state before it may reach disk and again once it is
durable. The parent kills it with SIGKILL at a random moment."""

import hashlib
import sys

import numpy as np

from tests.helpers import SPEC, Harness, HostEngine, read_all
from tierd.core.store import make_key

BT = SPEC.block_tokens


def say(*words) -> None:
    sys.stdout.write(" ".join(str(w) for w in words) + "\n")
    sys.stdout.flush()


def digest(pages: list[bytes]) -> str:
    return hashlib.sha256(b"".join(pages)).hexdigest()


def main(root: str, seed: int, codec: str) -> None:
    rng = np.random.default_rng(seed)
    h = Harness(root, host_budget=8 << 20, host_slab=4 << 20, disk_budget=64 << 20, disk_slab=16 << 20,
                disk_codec=codec)
    store = h.open()
    engine = HostEngine(num_blocks=64, seed=seed)
    content: dict[str, list[bytes]] = {}
    for key in store.keys():  # what survived earlier runs
        info, chunks = store.get(key)
        data = read_all(chunks)
        content[key.session_id] = [data[i : i + SPEC.page_bytes] for i in range(0, len(data), SPEC.page_bytes)]
    say("READY")
    step = 0
    while True:
        step += 1
        name = f"s{rng.integers(0, 6)}"
        key = make_key("default", name)
        action = rng.choice(["save", "append", "append", "demote", "drop"])
        if action == "drop" and name in content:
            say("DROP", name)
            store.drop(key)
            del content[name]
            continue
        if action == "demote" and name in content:
            store.demote(key)
            continue
        n = int(rng.integers(1, 5))
        blocks = rng.choice(64, size=n, replace=False)
        engine.randomize(blocks, seed * 100_000 + step, 256 if codec == "none" else 16)  # (16: pages that code smaller)
        start = len(content[name]) if action == "append" and name in content else 0  # (0: stored again)
        pages = (content[name] if start else []) + engine.pages(blocks)
        say("STATE", name, len(pages) * BT, digest(pages))
        store.save(key, engine.memory, SPEC, blocks, len(pages) * BT, start_token=start * BT)
        content[name] = pages
        store.write_back(key)
        say("DURABLE", name, len(pages) * BT, digest(pages))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
