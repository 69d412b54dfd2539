"""What every codec shares: the Codec protocol, the registry of codecs by
name, the shape a KV page is seen in (PageShape), and the one place where
a page's coding error is measured.

A page is coded alone: a codec turns each page's bytes into a blob of its
own and back, so any page can be read without its neighbours, and a tier
may hold a session's pages under one codec while another tier holds them
under another. Lossy codecs see a KV page as [layers, K/V, heads, tokens,
dim] of its dtype (PageShape); opaque snapshots, and KV of an arrangement
tierd does not know, have no shape and are coded only losslessly. Pure
functions of their arguments: any thread (the movers and the publisher
code; never the event loop)."""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Protocol
from typing import TYPE_CHECKING

import numpy as np

from tierd.errors import DataLoss, InvalidArgument, shown
from tierd.layout import DTYPE_BYTES, KVSpec

if TYPE_CHECKING:
    import torch

# Element types a lossy codec reads (wider ones; 1-byte caches pass through unchanged). torch does a
# lossy codec's arithmetic; it is imported by the first call that needs it (a daemon that codes
# nothing lossily never loads it).
FLOATS = ("float32", "float16", "bfloat16")
# Arrangements tierd knows the order of, by how the arrangement string ends: each names how
# a layer's part of a page orders K and V, heads, tokens and dim. vLLM's CPU backend keeps a
# layer's block as [heads, block_size, 2 * dim] in the layout of the kernels of its ISA; with
# its "vec" kernels (checked against transformers' own K and V: tests/vllm), each head's K
# transposed ([dim, tokens]), then its V ([tokens, dim]). Its other ISAs' layouts, and its GPU
# backends', are not among them: their pages are coded lossless only.
ORDERS = {
    "layer,kv,head,token,dim": "kv,head,token,dim",
    "layer,kv,token,head,dim": "kv,token,head,dim",
    "vllm:cpu:vec:[blocks,kv_heads,block_size,C]": "head,kv:k-transposed",
}


def _in_order(order: str, c: torch.Tensor) -> torch.Tensor:
    """A layer's canonical [2, heads, tokens, dim] in the order its bytes hold it (flattened)."""
    import torch

    if order == "kv,head,token,dim":
        return c.reshape(-1)
    if order == "kv,token,head,dim":
        return c.permute(0, 2, 1, 3).reshape(-1)
    if order == "head,kv:k-transposed":
        heads = c.shape[1]
        return torch.stack([c[0].transpose(1, 2).reshape(heads, -1), c[1].reshape(heads, -1)], dim=1).reshape(-1)
    raise ValueError(f"no KV order {order!r}")


@functools.cache
def _positions(order: str, heads: int, tokens: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Index tensors (where, back) over a layer's elements: the layer's bytes
    in their order are canonical[where], and canonical is layer[back]."""
    import torch

    where = _in_order(order, torch.arange(2 * heads * tokens * dim).view(2, heads, tokens, dim))
    return where, torch.argsort(where)


@dataclass(frozen=True, slots=True)
class PageShape:
    """How a KV page's bytes are laid out: per layer, K and V, heads, tokens
    and dim elements of dtype, in `order` (how a layer's bytes order them)."""

    layers: int
    heads: int
    tokens: int
    dim: int
    dtype: str
    order: str = "kv,head,token,dim"  # one of ORDERS' values

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype) if self.dtype in FLOATS else torch.uint8

    @property
    def page_bytes(self) -> int:
        return 2 * self.layers * self.heads * self.tokens * self.dim * self.itemsize

    @property
    def codable(self) -> bool:
        """Whether a lossy codec can read it (wider than a byte)."""
        return self.dtype in FLOATS

    def values(self, pages: np.ndarray) -> torch.Tensor:
        """Pages' bytes ([n, page_bytes], or one page) as float32 [n, layers, 2, heads, tokens, dim]."""
        import torch

        pages = np.ascontiguousarray(pages)
        if not pages.flags.writeable:  # (torch takes no read-only array: read, never written here)
            pages = pages.copy()
        x = torch.from_numpy(pages.reshape(-1, self.page_bytes)).view(self.torch_dtype).view(-1, self.layers,
                                                                                            self.page_bytes // self.itemsize // self.layers)
        if self.order != "kv,head,token,dim":
            x = x[..., _positions(self.order, self.heads, self.tokens, self.dim)[1]]
        return x.reshape(-1, self.layers, 2, self.heads, self.tokens, self.dim).to(torch.float32)

    def write(self, values: torch.Tensor, out: np.ndarray) -> None:
        """float32 [layers, 2, heads, tokens, dim] (one page) into its bytes, in its dtype and order."""
        import torch

        x = values.reshape(self.layers, -1)
        if self.order != "kv,head,token,dim":
            x = x[:, _positions(self.order, self.heads, self.tokens, self.dim)[0]]
        out[:] = x.to(self.torch_dtype).contiguous().view(torch.uint8).reshape(-1).numpy()


def page_shape(spec: KVSpec) -> PageShape | None:
    """The shape of the spec's pages, or None where a lossy codec cannot read them."""
    if spec.is_opaque:
        return None
    order = next((o for end, o in ORDERS.items() if spec.arrangement.endswith(end)), None)
    if order is None:
        return None
    return PageShape(spec.num_layers, spec.num_kv_heads, spec.block_tokens, spec.head_dim, spec.dtype, order)


def lossless_shape(spec: KVSpec) -> PageShape | None:
    """The shape a lossless codec reads the spec's pages in: its page_shape,
    or, for KV of an arrangement tierd does not know, one of the same
    elements (byte planes need their width alone: every page is whole
    elements); None for opaque snapshots. Never one a lossy codec is given."""
    if spec.is_opaque:
        return None
    return page_shape(spec) or PageShape(1, 1, spec.page_bytes // DTYPE_BYTES[spec.dtype], 1, spec.dtype)


class Codec(Protocol):
    """One codec: `name` is what an index row or a manifest records of each
    page coded with it; `lossy` whether decode(encode(page)) may differ from
    the page. encode takes pages [n, page_bytes] (uint8) and returns each
    page's blob; decode writes one page's bytes into out (uint8, page_bytes).
    Both are deterministic: the same blob always decodes to the same bytes."""

    name: str
    lossy: bool

    def encode(self, pages: np.ndarray, shape: PageShape | None) -> list[bytes]: ...

    def decode(self, blob: bytes | memoryview, shape: PageShape | None, out: np.ndarray) -> None: ...


SMALLEST_ERROR = float(np.finfo(np.float32).tiny)  # the relative error of a page whose bytes changed, no value

# The first byte of a lossy codec's blob: the page as it is (a 1-byte cache, or a page it must not
# scale), or coded.
AS_IS, CODED = 0, 1


def as_is(page: np.ndarray) -> bytes:
    """A lossy codec's blob of a page kept as it is."""
    return bytes([AS_IS]) + page.tobytes()


def coded_bytes(name: str, blob: bytes | memoryview, shape: PageShape | None, size: int,
                out: np.ndarray) -> memoryview | None:
    """A lossy codec's blob read: where it holds the page as it is, the page
    is written into out (None); else its coded bytes, which must be `size`
    long. DataLoss for anything else."""
    view = memoryview(blob)
    if len(view) == out.size + 1 and view[0] == AS_IS:
        out[:] = np.frombuffer(view[1:], dtype=np.uint8)
        return None
    if shape is None or not len(view) or view[0] != CODED:
        raise DataLoss(f"a page of the {name} codec that does not decode")
    if len(view) != 1 + size:
        raise DataLoss(f"a page of the {name} codec of {len(view)} bytes, not the {1 + size} its shape gives")
    return view[1:]


_CODECS: dict[str, Codec] = {}
_LATER: dict[str, str] = {}  # name -> the module that registers it, imported when the codec is first asked for


def register(codec: Codec) -> Codec:
    """Make a codec known by its name (each codec module registers its own)."""
    if codec.name in _CODECS and _CODECS[codec.name] is not codec:
        raise ValueError(f"a codec named {codec.name!r} is registered already")
    _CODECS[codec.name] = codec
    return codec


def register_later(name: str, module: str) -> None:
    """Make a codec known by its name before its module is imported (one
    that loads torch): get() imports the module, which registers it."""
    _LATER[name] = module


def names() -> list[str]:
    return sorted(set(_CODECS) | set(_LATER))


def get(name: str) -> Codec:
    """The codec of this name; InvalidArgument (saying which are known) for any other."""
    if isinstance(name, str) and name in _LATER and name not in _CODECS:
        importlib.import_module(_LATER[name])
    codec = _CODECS.get(name) if isinstance(name, str) else None
    if codec is None:
        raise InvalidArgument(f"unknown codec {shown(name)}; codecs are {', '.join(names())}", field="codec",
                              value=name)
    return codec


def for_spec(name: str, spec: KVSpec) -> Codec:
    """The codec, where it may code the spec's pages: a lossy codec never codes
    opaque snapshots, nor KV whose arrangement tierd does not know."""
    codec = get(name)
    if codec.lossy and page_shape(spec) is None:
        what = "opaque snapshots" if spec.is_opaque else f"KV arranged as {shown(spec.arrangement)}"
        raise InvalidArgument(f"the {name} codec is lossy and codes no {what}: use lossless", field="codec",
                              value=name)
    return codec


@dataclass(frozen=True)
class Coded:
    """Pages coded: each page's blob, and the error decoding it gives back
    (relative L2 and largest absolute difference, per page; 0 where lossless)."""

    blobs: list[bytes]
    rel_error: np.ndarray  # float32 [n]
    max_error: np.ndarray  # float32 [n]
    decoded: np.ndarray | None = None  # with keep: each page as its blob decodes, [n, page_bytes] (lossy codecs)

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.blobs)


def code(codec: Codec, pages: np.ndarray, shape: PageShape | None, keep: bool = False) -> Coded:
    """Encode pages [n, page_bytes]; for a lossy codec, decode each blob
    again and measure what it changed, against the page (keep: and keep
    what it decoded to)."""
    blobs = codec.encode(pages, shape)
    n = len(blobs)
    rel, worst = np.zeros(n, dtype=np.float32), np.zeros(n, dtype=np.float32)
    decoded = None
    if codec.lossy and shape is not None and shape.codable:
        decoded = np.empty((n if keep else 1, pages.shape[1]), dtype=np.uint8)
        for i, blob in enumerate(blobs):
            back = decoded[i if keep else 0]
            codec.decode(blob, shape, back)
            rel[i], worst[i] = (at_least(e) for e in error(shape, pages[i], back))
    return Coded(blobs, rel, worst, decoded if keep else None)


def error(shape: PageShape, page: np.ndarray, decoded: np.ndarray) -> tuple[float, float]:
    """(relative L2 error, largest absolute error) of decoded against page
    (a value that is not finite and changed: inf). 0 only where the bytes are
    the same: a page that differs only where values compare equal (-0.0 for
    0.0) has the smallest relative error there is, not none."""
    if np.array_equal(page, decoded):
        return 0.0, 0.0
    import torch

    # In float64: the bound a page is held to must hold against the values as they are, not as float32
    # rounds their differences (its norms came out low by ~5e-5 of the error on 1 MiB pages).
    x, y = shape.values(page)[0].double(), shape.values(decoded)[0].double()
    diff = torch.where(x == y, torch.zeros_like(x), y - x).nan_to_num(nan=float("inf"))
    norm = float(torch.linalg.vector_norm(x.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)))
    err = float(torch.linalg.vector_norm(diff))
    rel = err / norm if norm else (0.0 if err == 0 else float("inf"))
    return max(rel, SMALLEST_ERROR), float(diff.abs().max())


def at_least(value: float) -> np.float32:
    """value as a float32 no smaller than it: an error kept in float32 is never reported below what it is."""
    low = np.float32(value)
    return low if float(low) >= value else np.nextafter(low, np.float32(np.inf))  # (compared as float64)
