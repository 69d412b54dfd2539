"""llama-cpp-python, in-process: its conversations kept in tierd, a
sequence's state at a time. One line installs it:

    from tierd.adapters.llamacpp import attach
    attach(llm)                      # llm: a llama_cpp.Llama; tierd on its default socket

After each completion, llama-cpp-python's cache hook stores the state of
the sequence it decoded (llama_state_seq_get_data: the KV of its tokens,
not the whole context with its logits) as a tierd session, written by
llama.cpp straight into shared memory the daemon lends for the save (a
BeginSave lease); the conversation's earlier turn, a prefix of it, is
dropped, so each conversation holds one session. When a prompt starts with
a stored conversation's tokens, its state is read back through a restore
lease and set into llama.cpp from that memory (llama_state_seq_set_data):
the tokens are not decoded again. No byte stream carries the state.

What a restore gave is checked from llama.cpp's own counts: the tokens its
memory holds once the state is set, and, when the next completion is
stored, how many it decoded meanwhile (llama_perf_context). A restore
llama.cpp refused, or after which every token was decoded again (a memory
that cannot keep the prefix), is a miss: counted, logged with the model's
kind (dense, swa, hybrid, recurrent), never a hit; so is a damaged state,
another identity's (llamacpp_state.context_identity: a state is never set
into another model or setting) or tierd unreachable: the turn is decoded
as without tierd, and a completion tierd cannot store stands.

prefetch(prompt), on a hint that a conversation is back, has the daemon
bring its state into shared memory on a thread of the cache's (a staged
restore lease, adapters/staged.py): the turn's restore is then llama.cpp's
copy alone. Runs in the application's process, on the thread that calls
the Llama (and the staging thread).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from tierd.adapters.llamacpp_state import (Counts, Stored, context_identity, fingerprint, head_bytes, read_head,
                                           session_id, tokens_named, write_head)
from tierd.adapters.staged import StagedRestore, save_opaque
from tierd.client import Arena, Client, DataLoss, IdentityMismatch, KVSpec, NotFound, TierdError

log = logging.getLogger("tierd.llamacpp")

try:
    import llama_cpp
    from llama_cpp.llama_cache import BaseLlamaCache
except ImportError as exc:  # pragma: no cover - the adapter is for applications that have it
    raise ImportError("tierd.adapters.llamacpp needs llama-cpp-python (pip install llama-cpp-python)") from exc

PAGE_BYTES = 1 << 20  # pages of the stored snapshots


def model_kind(model: Any) -> str:
    """dense, swa, hybrid or recurrent: what a miss is logged with."""
    if llama_cpp.llama_model_is_recurrent(model):
        return "recurrent"
    if llama_cpp.llama_model_is_hybrid(model):
        return "hybrid"
    return "swa" if llama_cpp.llama_model_n_swa(model) > 0 else "dense"


def _pointer(buf: np.ndarray, offset: int) -> Any:
    return ctypes.cast(buf.ctypes.data + offset, ctypes.POINTER(ctypes.c_uint8))


class TierdLlamaCache(BaseLlamaCache):
    """llama-cpp-python's cache, backed by tierd (attach() installs it)."""

    def __init__(self, llm: Any, client: Client | None = None, namespace: str | None = None,
                 seq_id: int = 0) -> None:
        super().__init__(capacity_bytes=0)
        self.llm, self.seq_id = llm, seq_id
        self.client = client if client is not None else Client()
        self.arena = Arena()
        self.model_fingerprint = fingerprint(llm.model_path)
        self.kind = model_kind(llm.model)
        self.spec = KVSpec.opaque(f"llama.cpp/{self.model_fingerprint}", f"llama-cpp-python-{llama_cpp.__version__}",
                                  page_bytes=PAGE_BYTES, extra=context_identity(llm, self.kind))
        self.namespace = namespace or xxhash.xxh3_64_hexdigest(f"{self.spec.model_id};{self.spec.extra}".encode())
        self.counts = Counts()
        self._arena_lock = threading.Lock()  # the arena's mappings: the staging thread maps too
        self.staged = StagedRestore(self.client, self.spec, self._mapped)
        self._known: dict[str, int] = {}  # session id -> tokens, of this namespace
        self._base: tuple[str, int] | None = None  # the session llama.cpp's memory continues, and its tokens
        self._restored: tuple[str, int, int] | None = None  # (session, tokens set, llama.cpp's decode count then)
        for info in self.client.list():
            n = tokens_named(self.namespace, info.session_id)
            if n is not None:
                self._known[info.session_id] = n

    # -- llama-cpp-python's cache interface ------------------------------------------------

    @property
    def cache_size(self) -> int:
        return 0  # tierd's budgets bound what it holds

    def _find_longest_prefix_key(self, key: Sequence[int]) -> Stored | None:
        tokens = np.asarray(key, dtype=np.int64)
        for n in sorted({n for n in self._known.values() if n <= len(tokens)}, reverse=True):
            sid = self._id(tokens[:n])
            if sid in self._known:
                return Stored(sid, tokens[:n].copy(), n)
        return None

    def __getitem__(self, key: Sequence[int]) -> Stored:
        found = self._find_longest_prefix_key(key)
        if found is None:
            raise KeyError("no stored conversation starts the prompt")
        return found

    def __contains__(self, key: Sequence[int]) -> bool:
        return self._find_longest_prefix_key(key) is not None

    def __setitem__(self, key: Sequence[int], value: Any) -> None:
        self.save()

    # -- the work ----------------------------------------------------------------------------

    def _id(self, tokens: np.ndarray) -> str:
        return session_id(self.namespace, tokens)

    def _mapped(self, lease: Any) -> np.ndarray:
        """The lease's memory, mapped here and its pages faulted in (uint8)."""
        with self._arena_lock:
            [(_, rows)] = self.arena.runs(lease)
        buf = rows.reshape(-1)
        buf[::4096].max(initial=0)  # touch each page: the copy that follows takes no page faults
        return buf

    def _memory(self) -> Any:
        return llama_cpp.llama_get_memory(self.llm._ctx.ctx)

    def held_tokens(self) -> int:
        """The tokens llama.cpp's memory holds for the sequence."""
        return int(llama_cpp.llama_memory_seq_pos_max(self._memory(), self.seq_id)) + 1

    def _decoded(self) -> int:
        perf = llama_cpp.llama_perf_context(self.llm._ctx.ctx)
        return int(perf.n_p_eval) + int(perf.n_eval)

    def save(self) -> str | None:
        """Store the sequence's state as a session (and drop the turn it
        continued); returns its id, None if llama.cpp's memory and the
        Llama disagree on what it holds (nothing is stored then)."""
        llm, ctx = self.llm, self.llm._ctx.ctx
        self._check_reuse()
        n = llm.n_tokens
        if n <= 0 or self.held_tokens() != n:
            log.warning("not stored: llama.cpp holds %d tokens, the Llama %d", self.held_tokens(), n)
            return None
        tokens = np.asarray(llm.input_ids[:n], dtype=np.int64)
        sid = self._id(tokens)
        state, head = int(llama_cpp.llama_state_seq_get_size(ctx, self.seq_id)), head_bytes(n)
        try:
            wrote = self._store(sid, n, tokens, state, head)
        except TierdError as exc:  # tierd is a cache: the completion stands, unstored
            self.counts.save_failures += 1
            log.warning("llama.cpp state of %d tokens not stored in tierd: %s", n, exc)
            return None
        self._known[sid] = n
        self.counts.saves += 1
        self.counts.saved_bytes += head + wrote
        if self._base is not None and self._base[0] != sid and self._base[1] <= n and \
                self._id(tokens[: self._base[1]]) == self._base[0]:
            self._forget(self._base[0])  # the turn this one continued: a prefix of it
        self._base = (sid, n)
        return sid

    def _store(self, sid: str, n: int, tokens: np.ndarray, state: int, head: int) -> int:
        """Have llama.cpp write the state into a save lease, and commit it; returns the state's bytes."""
        def write(lease: Any) -> int:
            buf = self._mapped(lease)  # one segment, its pages back to back
            # llama.cpp writes the state straight into the daemon's memory
            wrote = int(llama_cpp.llama_state_seq_get_data(self.llm._ctx.ctx, _pointer(buf, head), state,
                                                           self.seq_id))
            if wrote <= 0:
                raise RuntimeError("llama.cpp wrote no state for the sequence")
            write_head(buf, tokens, wrote)
            return wrote

        return save_opaque(self.client, sid, self.spec, n, head + state, write)

    def _forget(self, sid: str) -> None:
        self._known.pop(sid, None)
        try:
            self.client.drop(sid)
        except TierdError:
            pass  # gone already, or tierd unreachable: the session stays until it is evicted

    def _miss(self, reason: str, sid: str, detail: str) -> None:
        self.counts.misses += 1
        self.counts.miss_reasons[reason] = self.counts.miss_reasons.get(reason, 0) + 1
        log.warning("llama.cpp restore miss (%s model): %s: session %s: %s", self.kind, reason, sid, detail)

    def _check_reuse(self) -> None:
        """After a restore, the completion that followed: how many of the
        tokens llama.cpp's memory holds it did not decode (its own counts)."""
        if self._restored is None:
            return
        sid, set_tokens, decoded = self._restored
        self._restored = None
        reused = self.held_tokens() - (self._decoded() - decoded)
        if reused <= 0:
            self.counts.restores -= 1
            self._miss("no reuse", sid, f"{set_tokens} tokens were set, and every token was decoded again")
        else:
            self.counts.reused_tokens += reused

    def load(self, stored: Stored) -> bool:
        """Set a stored conversation's state into llama.cpp; False (the
        Llama reset, to decode everything) if it gave nothing."""
        llm, ctx, sid = self.llm, self.llm._ctx.ctx, stored.session_id
        self._check_reuse()
        try:
            held = self.staged.take(sid) or self.staged.hold(sid)
        except NotFound:
            self._known.pop(sid, None)
            self._miss("gone", sid, "tierd holds it no more")
            return self._reset()
        except IdentityMismatch as exc:
            self._miss("another model", sid, str(exc))
            return self._reset()
        except DataLoss as exc:  # damaged: never set into llama.cpp, and not asked for again
            self._miss("damaged", sid, str(exc))
            self._forget(sid)
            return self._reset()
        except TierdError as exc:  # tierd unreachable, say: the turn is decoded as without it
            self._miss(type(exc).__name__, sid, str(exc))
            return self._reset()
        try:
            buf = self._mapped(held.lease)[: held.lease.nbytes]
            state, n, head = read_head(buf, stored.input_ids), stored.n_tokens, head_bytes(stored.n_tokens)
            if state is None:
                self._miss("other tokens", sid, "the snapshot is not a state of the prompt's tokens")
                return self._reset()
            llama_cpp.llama_memory_seq_rm(self._memory(), self.seq_id, -1, -1)
            # set from the daemon's memory, where the lease put it
            got = int(llama_cpp.llama_state_seq_set_data(ctx, _pointer(buf, head), state, self.seq_id))
        finally:
            if not self.staged.end(held):
                got = 0  # read past the lease's time: what was read may have been another's
        if got != state or self.held_tokens() != n:
            self._miss("refused", sid, f"llama.cpp took {got} of {state} bytes, holds {self.held_tokens()} of {n}")
            return self._reset()
        llm.input_ids[:n] = stored.input_ids
        llm.n_tokens = n
        llm._requires_eval = True  # the logits are not restored: the next token is decoded again
        self.counts.restores += 1
        self.counts.restored_bytes += head + state
        self._base, self._restored = (sid, n), (sid, n, self._decoded())
        return True

    def _reset(self) -> bool:
        llama_cpp.llama_memory_seq_rm(self._memory(), self.seq_id, -1, -1)
        self.llm.n_tokens = 0
        self._base = None
        return False

    def prefetch(self, prompt: Sequence[int], wait: bool = False) -> bool:
        """Stage the stored conversation the prompt starts with, for the
        call's restore (module docstring); False if none does. wait: return
        once it is staged."""
        found = self._find_longest_prefix_key(prompt)
        if found is None:
            return False
        self.staged.begin(found.session_id)
        if wait:
            self.staged.wait()
        return True

    def close(self) -> None:
        self.staged.drop()
        self.arena.close()


def attach(llm: Any, client: Client | None = None, namespace: str | None = None) -> TierdLlamaCache:
    """Keep llm's conversations in tierd: install the cache, and have llm's
    cache hook move the sequence's state (not the whole context's) through it."""
    cache = TierdLlamaCache(llm, client, namespace)
    llm.set_cache(cache)
    llm.save_state = lambda: None  # the hook's value: the cache reads the sequence's state itself
    llm.load_state = cache.load
    return cache
