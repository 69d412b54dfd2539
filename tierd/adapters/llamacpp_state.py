"""What tierd.adapters.llamacpp stores of a llama.cpp sequence, and under
which names and identity; no llama.cpp needed here. A stored state is one
opaque snapshot: a header (magic, format, the tokens it holds, the bytes
of llama.cpp's state), the tokens (int32), then the state as
llama_state_seq_get_data wrote it. A session is named
<namespace>-<tokens>-<digest of the tokens>; the tokens in the snapshot
are compared with the prompt's before the state is used, so a digest that
collided would give a miss, never another conversation's KV. Runs in the
application's process."""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass, field

import numpy as np

MAGIC = b"TIERDLLC"
HEADER = struct.Struct("<8sIIQ")  # magic, format, tokens, state bytes
FORMAT = 1
SAMPLES = 16  # blocks of tensor data a fingerprint reads, spread over the file
SAMPLE_BYTES = 64 << 10
HEAD_BYTES = 1 << 20  # the start of a GGUF a fingerprint reads whole: its header and metadata


def fingerprint(path: str) -> str:
    """A digest of a GGUF file that tells models apart without reading all of
    it (gigabytes): its size, its first MiB (the header and metadata: the
    architecture, vocabulary and shapes) and SAMPLES blocks of its data,
    spread over the file (weights of another seed or fine-tune differ there)."""
    size = os.path.getsize(path)
    h = hashlib.blake2b(digest_size=16)
    h.update(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        h.update(f.read(HEAD_BYTES))
        for i in range(SAMPLES):
            f.seek(size * i // SAMPLES)
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def session_id(namespace: str, tokens: np.ndarray) -> str:
    digest = hashlib.blake2b(np.asarray(tokens).astype("<i4").tobytes(), digest_size=12).hexdigest()
    return f"{namespace}-{len(tokens)}-{digest}"


def tokens_named(namespace: str, sid: str) -> int | None:
    """The tokens a session of the namespace holds, by its name; None for another name."""
    parts = sid.split("-")
    if len(parts) != 3 or parts[0] != namespace or not parts[1].isdigit():
        return None
    return int(parts[1])


def head_bytes(n_tokens: int) -> int:
    """Bytes before the state: the header and the tokens."""
    return HEADER.size + 4 * n_tokens


def write_head(buf: np.ndarray, tokens: np.ndarray, state: int) -> None:
    """The header and tokens, at the start of buf (uint8)."""
    buf[: HEADER.size] = np.frombuffer(HEADER.pack(MAGIC, FORMAT, len(tokens), state), np.uint8)
    buf[HEADER.size : head_bytes(len(tokens))] = np.frombuffer(np.asarray(tokens).astype("<i4").tobytes(), np.uint8)


def read_head(buf: np.ndarray, want: np.ndarray) -> int | None:
    """The bytes of the state after the header of a stored snapshot (buf,
    uint8) that holds exactly the tokens `want`; None for anything else (not
    a snapshot of this format, cut short, or other tokens)."""
    if buf.size < HEADER.size:
        return None
    magic, fmt, n, state = HEADER.unpack_from(buf.data)
    head = head_bytes(n)
    if magic != MAGIC or fmt != FORMAT or n != len(want) or head + state > buf.size or state <= 0:
        return None
    return state if np.array_equal(buf[HEADER.size : head].view("<i4"), want) else None


@dataclass
class Stored:
    """What the cache hands llama-cpp-python for a stored conversation: its
    tokens (input_ids, compared with the prompt) and the session holding them."""

    session_id: str
    input_ids: np.ndarray
    n_tokens: int


@dataclass
class Counts:
    """What the cache did, by llama.cpp's own counts."""

    saves: int = 0
    saved_bytes: int = 0
    restores: int = 0  # states set into llama.cpp that gave reuse
    restored_bytes: int = 0
    reused_tokens: int = 0  # tokens not decoded again, as llama.cpp counted them
    misses: int = 0  # restores refused, failed or that gave no reuse
    miss_reasons: dict[str, int] = field(default_factory=dict)
