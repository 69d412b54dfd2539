"""Identity and KV layout: what the bytes of a snapshot mean.

A KVSpec names the model and the shape and arrangement of its KV cache; its
fingerprint is what a snapshot records and what a restore must match. An
EngineLayout says where, in an engine's registered memory, each block's bytes
live, so the copy engine can gather blocks into pages and scatter them back.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field, fields

from tierd.errors import InvalidArgument, shown

DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
KIND_KV = "kv"
KIND_OPAQUE = "opaque"
DEFAULT_ARRANGEMENT = "layer,kv,token,head,dim"
DEFAULT_OPAQUE_PAGE_BYTES = 1 << 20
MAX_PAGE_BYTES = 1 << 30
# Every page takes at least one 4 KiB granule of a tier (and its own checksum
# and token hash): smaller pages would let a few bytes hold a granule each.
MIN_PAGE_BYTES = 4096
# An opaque snapshot's last page takes a whole page whatever it holds: with
# pages of 32 MiB, eight 1-byte Puts held 224 MiB of the host tier.
MAX_OPAQUE_PAGE_BYTES = 16 << 20
_NAME = re.compile(r"[\x21-\x7e]{1,256}")


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidArgument(f"{name} must be an integer in [{lo}, {hi}], got {shown(value)}", field=name, value=value)


def _check_text(name: str, value: object, *, empty_ok: bool) -> None:
    if not isinstance(value, str) or (value == "" and not empty_ok) or (value and not _NAME.fullmatch(value)):
        raise InvalidArgument(
            f"{name} must be {'' if empty_ok else 'a non-empty '}printable ASCII text without spaces, "
            f"at most 256 characters, got {shown(value)}",
            field=name,
            value=value,
        )


@dataclass(frozen=True, slots=True)
class KVSpec:
    """The identity of a snapshot's bytes. Two specs with the same fingerprint
    mean the same bytes; anything else is an identity mismatch."""

    model_id: str
    revision: str = ""
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype: str = "uint8"
    block_tokens: int = 1
    layout_version: int = 1
    arrangement: str = DEFAULT_ARRANGEMENT
    kind: str = KIND_KV
    opaque_page_bytes: int = 0
    extra: str = ""
    _fingerprint: str = field(init=False, repr=False, compare=False, default="")

    def __post_init__(self) -> None:
        _check_text("model_id", self.model_id, empty_ok=False)
        _check_text("revision", self.revision, empty_ok=True)
        _check_text("arrangement", self.arrangement, empty_ok=False)
        if not isinstance(self.extra, str) or len(self.extra) > 4096:
            raise InvalidArgument("extra must be text of at most 4096 characters", field="extra")
        _check_int("layout_version", self.layout_version, 1, 1 << 20)
        if self.kind == KIND_KV:
            _check_int("num_layers", self.num_layers, 1, 4096)
            _check_int("num_kv_heads", self.num_kv_heads, 1, 4096)
            _check_int("head_dim", self.head_dim, 1, 65536)
            _check_int("block_tokens", self.block_tokens, 1, 1 << 20)
            if self.dtype not in DTYPE_BYTES:
                raise InvalidArgument(
                    f"dtype {shown(self.dtype)} is not one of {sorted(DTYPE_BYTES)}", field="dtype", value=self.dtype
                )
            if self.opaque_page_bytes:
                raise InvalidArgument("opaque_page_bytes is only for opaque specs", field="opaque_page_bytes")
            if self.page_bytes > MAX_PAGE_BYTES:
                raise InvalidArgument(
                    f"a page of {self.block_tokens} tokens is {self.page_bytes} bytes, over the "
                    f"{MAX_PAGE_BYTES}-byte limit: use fewer tokens per block",
                    field="block_tokens",
                    value=self.block_tokens,
                )
            if self.page_bytes < MIN_PAGE_BYTES:
                raise InvalidArgument(
                    f"a page of {self.block_tokens} tokens is {self.page_bytes} bytes, under the "
                    f"{MIN_PAGE_BYTES}-byte minimum: use more tokens per block",
                    field="block_tokens",
                    value=self.block_tokens,
                )
        elif self.kind == KIND_OPAQUE:
            _check_int("opaque_page_bytes", self.opaque_page_bytes, MIN_PAGE_BYTES, MAX_OPAQUE_PAGE_BYTES)
            if (self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.block_tokens) != (0, 0, 0, "uint8", 1):
                raise InvalidArgument("an opaque spec has no layers, heads, head_dim, dtype or block_tokens", field="kind")
        else:
            raise InvalidArgument(f"kind must be 'kv' or 'opaque', got {shown(self.kind)}", field="kind",
                                  value=self.kind)
        # Stable across processes and versions of tierd: a hash of every field. Computed once.
        object.__setattr__(self, "_fingerprint", hashlib.sha256(self.to_json().encode()).hexdigest()[:32])

    @classmethod
    def opaque(cls, model_id: str, revision: str = "", *, page_bytes: int = DEFAULT_OPAQUE_PAGE_BYTES,
               extra: str = "") -> KVSpec:
        """A spec for bytes whose structure tierd does not know (llama.cpp state, say)."""
        return cls(model_id=model_id, revision=revision, kind=KIND_OPAQUE, opaque_page_bytes=page_bytes, extra=extra)

    @property
    def is_opaque(self) -> bool:
        return self.kind == KIND_OPAQUE

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer for one token; 0 for opaque specs."""
        if self.is_opaque:
            return 0
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def page_bytes(self) -> int:
        return self.opaque_page_bytes if self.is_opaque else self.block_tokens * self.bytes_per_token

    def pages_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_tokens)

    def to_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> KVSpec:
        known = {f.name for f in fields(cls) if f.init}
        unknown = set(data) - known
        if unknown:
            raise InvalidArgument(f"unknown spec fields {sorted(unknown)}", fields=sorted(unknown))
        return cls(**data)  # type: ignore[arg-type]

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @property
    def fingerprint(self) -> str:
        return self._fingerprint


@dataclass(frozen=True, slots=True)
class Segment:
    """One piece of every block: block b's bytes for this segment sit at
    region[offset + b * stride : offset + b * stride + nbytes]."""

    region: int
    offset: int
    stride: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class EngineLayout:
    """Where a block's bytes live in an engine's memory.

    A page is the concatenation, in order, of each segment's bytes for one
    block. A layer-major engine (one K and one V tensor per layer) has
    2 x layers segments; a cross-layer engine has one.
    """

    num_blocks: int
    segments: tuple[Segment, ...]
    page_offsets: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        _check_int("num_blocks", self.num_blocks, 1, 1 << 40)
        if not self.segments:
            raise InvalidArgument("an engine layout needs at least one segment", field="segments")
        offsets, total = [], 0
        for i, seg in enumerate(self.segments):
            for name in ("region", "offset", "stride", "nbytes"):
                _check_int(f"segments[{i}].{name}", getattr(seg, name), 0 if name != "nbytes" else 1, 1 << 50)
            if self.num_blocks > 1 and seg.stride < seg.nbytes:
                raise InvalidArgument(
                    f"segments[{i}]: stride {seg.stride} is smaller than its {seg.nbytes} bytes, so blocks overlap",
                    field="segments",
                )
            offsets.append(total)
            total += seg.nbytes
        object.__setattr__(self, "page_offsets", tuple(offsets))

    @property
    def page_bytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def check(self, spec: KVSpec, region_sizes: list[int]) -> None:
        """Raise InvalidArgument unless this layout fits the spec and the regions
        (an opaque spec's blocks are whole pages: memory it is read into)."""
        if self.page_bytes != spec.page_bytes:
            raise InvalidArgument(
                f"the segments hold {self.page_bytes} bytes per block but the spec needs {spec.page_bytes} "
                + ("(its pages' size)" if spec.is_opaque else
                   f"({spec.block_tokens} tokens x {spec.bytes_per_token} bytes)"),
                field="segments",
                got=self.page_bytes,
                want=spec.page_bytes,
            )
        for i, seg in enumerate(self.segments):
            if seg.region >= len(region_sizes):
                raise InvalidArgument(f"segments[{i}] names region {seg.region}, but only {len(region_sizes)} were given",
                                      field="segments")
            end = seg.offset + (self.num_blocks - 1) * seg.stride + seg.nbytes
            if end > region_sizes[seg.region]:
                raise InvalidArgument(
                    f"segments[{i}]: block {self.num_blocks - 1} ends at byte {end}, past the end of region "
                    f"{seg.region} ({region_sizes[seg.region]} bytes)",
                    field="segments",
                )

    @classmethod
    def layer_major(cls, spec: KVSpec, num_blocks: int) -> EngineLayout:
        """One region per layer and K/V (2 x layers regions, K first), each [blocks, block bytes]."""
        nbytes = spec.page_bytes // (2 * spec.num_layers)
        return cls(num_blocks, tuple(Segment(r, 0, nbytes, nbytes) for r in range(2 * spec.num_layers)))

    @classmethod
    def cross_layer(cls, spec: KVSpec, num_blocks: int) -> EngineLayout:
        """One region holding whole pages back to back."""
        return cls(num_blocks, (Segment(0, 0, spec.page_bytes, spec.page_bytes),))
