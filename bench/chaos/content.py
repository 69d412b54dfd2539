"""What the campaign's sessions hold: pages that name themselves. Every page
(every segment of an engine's block) begins with a header naming tenant,
session, version and page; the rest follows from the header by a seeded
generator. A page read back is identified from its own bytes, so a check
needs no copy of what was written: a page whose rest does not follow from its
header is wrong bytes, one that names another tenant crossed tenants.

Runs in the campaign's process (its workers' threads)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

HEADER = 64  # bytes: b"chaos|TENANT|SESSION|VERSION|PAGE|PART|NBYTES|" padded with spaces
MAGIC = b"chaos|"


@dataclass(frozen=True, slots=True)
class Label:
    tenant: str
    session: str  # a prefix family's shared pages name the family ("prefix-N"), not a session
    version: int
    page: int
    part: int = 0  # the segment of an engine's block


def _rest(header: bytes, nbytes: int) -> bytes:
    seed = int.from_bytes(hashlib.blake2b(header, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def page(label: Label, nbytes: int) -> bytes:
    """The bytes of one page (nbytes >= HEADER)."""
    text = f"chaos|{label.tenant}|{label.session}|{label.version}|{label.page}|{label.part}|{nbytes}|".encode()
    assert len(text) <= HEADER and nbytes >= HEADER, (text, nbytes)
    header = text.ljust(HEADER)
    return header + _rest(header, nbytes - HEADER)


def identify(data: bytes) -> Label | None:
    """The label a page's bytes carry, or None where they are not a whole
    page of the campaign's (wrong bytes: a torn, mixed, cut or foreign page)."""
    header = bytes(data[:HEADER])
    if len(data) < HEADER or not header.startswith(MAGIC):
        return None
    fields = header.rstrip(b" ").split(b"|")
    if len(fields) != 8 or fields[7] != b"":
        return None
    try:
        label = Label(fields[1].decode(), fields[2].decode(), int(fields[3]), int(fields[4]), int(fields[5]))
        if int(fields[6]) != len(data):  # cut short, or run on into the next
            return None
    except (UnicodeDecodeError, ValueError):
        return None
    return label if bytes(data[HEADER:]) == _rest(header, len(data) - HEADER) else None


def pages(tenant: str, session: str, version: int, sizes: list[int],
          shared: tuple[str, int] | None = None) -> list[bytes]:
    """A version's pages; with shared=(family, n), its first n pages are the
    family's (the same tokens give the same KV whatever session holds them)."""
    out = []
    for i, nbytes in enumerate(sizes):
        if shared is not None and i < shared[1]:
            out.append(page(Label(tenant, shared[0], 0, i), nbytes))
        else:
            out.append(page(Label(tenant, session, version, i), nbytes))
    return out
