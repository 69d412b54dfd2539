"""The tierd.v1.Tierd servicer: one method per call of the service, each a
few lines from message to store and back, in groups of their own:
engine_calls.py (engine memory, Save, Restore), lease_calls.py (leases,
Lookup), stream_calls.py (Put, Get), control_calls.py (lifecycle,
inspection, control). What they share is context.py.

Runs on the daemon's event loop. Every call passes a gate as it starts
(api/gate.py): its token is checked from its metadata before its message is
even read, and it counts against its tenant's open calls; its message is
parsed by the handler (not by gRPC), so a malformed one is INVALID_ARGUMENT;
long id lists are read as arrays (wire/packed.py). Calls that copy bytes
or may wait on a session run on the RPC threads, at most a few per tenant
at once (api/limits.py); the waiting itself (a tenant's turn, WaitReady, a
stream's next message) is done on the loop, so a stalled or slow client
holds no thread. Every call is timed, and every TierdError becomes its one
gRPC status.
"""

from __future__ import annotations

from typing import Any

from tierd.api.context import CallContext
from tierd.api.control_calls import ControlCalls
from tierd.api.engine_calls import EngineCalls
from tierd.api.gate import SERVICE
from tierd.api.lease_calls import LeaseCalls
from tierd.api.stream_calls import StreamCalls


class TierdServicer:
    """Every call of the service, each its group's (what add_to_server registers)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        self.ctx = CallContext(*args, **kw)
        groups = (EngineCalls(self.ctx), LeaseCalls(self.ctx), StreamCalls(self.ctx), ControlCalls(self.ctx))
        for method in SERVICE.methods:
            owner = next(g for g in groups if hasattr(g, method.name))
            setattr(self, method.name, getattr(owner, method.name))
