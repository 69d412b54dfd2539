"""What tierd.adapters.llamacpp stores of a llama.cpp sequence, and under
which names and identity; no llama.cpp needed here. A stored state is one
opaque snapshot: a header (magic, format, the tokens it holds, the bytes
of llama.cpp's state), the tokens (int32), then the state as
llama_state_seq_get_data wrote it. A session is named
<namespace>-<tokens>-<digest of the tokens>; the tokens in the snapshot
are compared with the prompt's before the state is used, so a digest that
collided would give a miss, never another conversation's KV. Runs in the
application's process.

The identity a state is stored under (tierd refuses a restore under
another: IDENTITY_MISMATCH) covers the model (the XXH3-128 of the whole
GGUF, kept per file version; a LoRA adapter's too), the context's settings
that change what the KV holds (cache types, flash attention, RoPE and YaRN,
a full SWA cache), llama.cpp's version and the model's kind. Control
vectors are not seen by llama-cpp-python's Llama, so not covered: give
them a namespace of their own. The namespace defaults to a digest of the
identity."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

MAGIC = b"TIERDLLC"
HEADER = struct.Struct("<8sIIQ")  # magic, format, tokens, state bytes
FORMAT = 1
CHUNK = 16 << 20  # bytes a fingerprint reads at a time
KEPT = 256  # file versions whose fingerprints are kept


def fingerprint(path: str, cache_dir: str | None = None) -> str:
    """The XXH3-128 of a whole file (a GGUF, a LoRA adapter): two models
    differ in it wherever their bytes differ. Kept per version of the file
    (its path, inode, size, modification and change times) in cache_dir
    ($XDG_CACHE_HOME/tierd, else ~/.cache/tierd), so each version is read
    once; where that cannot be written, it is read every time."""
    real = os.path.realpath(path)
    st = os.stat(real)
    version = f"{real}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    base = cache_dir or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tierd")
    cache = os.path.join(base, "fingerprints.json")
    try:
        with open(cache) as f:
            known = json.load(f)
        if not isinstance(known, dict):
            known = {}
    except (OSError, ValueError):
        known = {}
    if isinstance(known.get(version), str):
        return known[version]
    h = xxhash.xxh3_128()
    with open(real, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    known[version] = digest
    known = dict(list(known.items())[-KEPT:])
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        tmp = f"{cache}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(known, f)
        os.replace(tmp, cache)
    except OSError:
        pass
    return digest


# The context's settings that change what the KV holds (the positions' rotation, the cache's types,
# attention's layout, what a sliding window keeps): a state is set only where they are the same.
KV_SETTINGS = ("type_k", "type_v", "flash_attn_type", "swa_full", "rope_scaling_type", "rope_freq_base",
               "rope_freq_scale", "yarn_ext_factor", "yarn_attn_factor", "yarn_beta_fast", "yarn_beta_slow",
               "yarn_orig_ctx")


def context_identity(llm: Any, kind: str) -> str:
    """The spec's extra: the model's kind, the KV settings and a LoRA adapter's fingerprint and scale."""
    params = llm.context_params
    parts = [f"kind={kind}"] + [f"{name}={getattr(params, name)}" for name in KV_SETTINGS]
    if llm.lora_path:
        parts.append(f"lora={fingerprint(llm.lora_path)}@{llm.lora_scale}")
    return ";".join(parts)


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
    save_failures: int = 0  # states tierd did not take (full, unreachable): the completion stands
    restores: int = 0  # states set into llama.cpp that gave reuse
    restored_bytes: int = 0
    reused_tokens: int = 0  # tokens not decoded again, as llama.cpp counted them
    misses: int = 0  # restores refused, failed or that gave no reuse
    miss_reasons: dict[str, int] = field(default_factory=dict)


# GGUF metadata value types (gguf's GGUFValueType) and the struct each fixed-size one is read with.
_GGUF_FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
RECURRENT_ARCHS = ("mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7")


def gguf_kind(path: str) -> str:
    """dense, swa, hybrid or recurrent, from a GGUF's metadata (its
    architecture, a sliding window, a state-space block), for a process that
    has the file but not the model loaded; "unknown" where it cannot be read."""
    try:
        keys = _gguf_keys(path)
    except (OSError, ValueError, struct.error):
        return "unknown"
    arch = keys.get("general.architecture")
    if not isinstance(arch, str):
        return "unknown"
    if arch in RECURRENT_ARCHS:
        return "recurrent"
    if any(k.startswith((f"{arch}.ssm.", f"{arch}.wkv.")) for k in keys):
        return "hybrid"
    return "swa" if keys.get(f"{arch}.attention.sliding_window") else "dense"


def _gguf_keys(path: str) -> dict[str, object]:
    """A GGUF's metadata, arrays left out (their keys kept, valued None)."""
    with open(path, "rb") as f:
        def take(fmt: str) -> object:
            size = struct.calcsize(fmt)
            data = f.read(size)
            if len(data) != size:
                raise ValueError("the GGUF ends inside its metadata")
            return struct.unpack(fmt, data)[0]

        def string() -> str:
            n = int(take("<Q"))  # type: ignore[call-overload]
            if n > 1 << 20:
                raise ValueError("a GGUF string longer than 1 MiB")
            return f.read(n).decode("utf-8", "replace")

        def skip(kind: int, count: int) -> None:
            if kind == _GGUF_STRING:
                for _ in range(count):
                    string()
            elif kind in _GGUF_FIXED:
                f.seek(struct.calcsize(_GGUF_FIXED[kind]) * count, os.SEEK_CUR)
            else:
                raise ValueError(f"GGUF value type {kind} in an array")

        if f.read(4) != b"GGUF" or int(take("<I")) < 2:  # type: ignore[call-overload]
            raise ValueError("not a GGUF of version 2 or later")
        take("<Q")  # tensors
        keys: dict[str, object] = {}
        for _ in range(int(take("<Q"))):  # type: ignore[call-overload]
            key, kind = string(), int(take("<I"))  # type: ignore[call-overload]
            if kind == _GGUF_STRING:
                keys[key] = string()
            elif kind == _GGUF_ARRAY:
                item, count = int(take("<I")), int(take("<Q"))  # type: ignore[call-overload]
                skip(item, count)
                keys[key] = None
            elif kind in _GGUF_FIXED:
                keys[key] = take(_GGUF_FIXED[kind])
            else:
                raise ValueError(f"GGUF value type {kind}")
        return keys
