"""The client's channel to the daemon, run in the caller's process: where the
daemon listens (and that its socket directory is this user's own), the
channel's options, credentials and token, and request messages whose
constructor refuses a caller's bad value as InvalidArgument (`pb`)."""

from __future__ import annotations

import os
import stat
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from tierd.config import default_runtime_dir
from tierd.errors import FailedPrecondition, InvalidArgument, shown
from tierd.v1 import tierd_pb2

DEFAULT_CHUNK = 1 << 20
MAX_MESSAGE = 64 << 20
RECONNECT_MS = 500
# Both clients' channels. gRPC waits 1 s after a failed connection attempt and
# 1.6 times longer after each next one, up to 120 s: after a 30 s outage a
# client found the restarted daemon ~10 s late. The daemon is local, or one
# hop away, so a client tries every RECONNECT_MS (+-20% jitter) while it is
# down, whatever the outage lasted. (grpc.min_reconnect_backoff_ms is not a
# backoff but how long one attempt may take; its 20 s stays.) Calls do not
# wait_for_ready: while the daemon is down they fail at once with
# UNAVAILABLE, and the caller (the vLLM connector: recompute) decides.
OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_MS), ("grpc.max_reconnect_backoff_ms", RECONNECT_MS)]
_HOLDS = {FieldDescriptor.TYPE_UINT32: "integers from 0 to 2**32-1",
          FieldDescriptor.TYPE_UINT64: "integers from 0 to 2**64-1",
          FieldDescriptor.TYPE_INT32: "integers from -2**31 to 2**31-1",
          FieldDescriptor.TYPE_INT64: "integers from -2**63 to 2**63-1",
          FieldDescriptor.TYPE_DOUBLE: "numbers", FieldDescriptor.TYPE_STRING: "text",
          FieldDescriptor.TYPE_BOOL: "true or false", FieldDescriptor.TYPE_BYTES: "bytes"}


class _Checked:
    """A message class whose constructor turns protobuf's refusal of a value
    (a negative count, an integer past its field's range, text where a number
    goes: a bare ValueError or TypeError) into the InvalidArgument the daemon
    gives for a bad value, naming the field."""

    def __init__(self, cls: type) -> None:
        self._cls = cls

    def __call__(self, **fields: Any) -> Any:
        try:
            return self._cls(**fields)
        except (TypeError, ValueError) as exc:
            name, value = next(((k, v) for k, v in fields.items() if not self._takes(k, v)), (None, None))
            if name is None:
                raise InvalidArgument(f"{self._cls.__name__}: {exc}") from None
            holds = _HOLDS.get(self._cls.DESCRIPTOR.fields_by_name[name].type, "values of another type")
            raise InvalidArgument(f"{name} cannot be {shown(value)}: it holds {holds}", field=name,
                                  value=value) from None

    def _takes(self, name: str, value: Any) -> bool:
        try:
            self._cls(**{name: value})
        except (TypeError, ValueError):
            return False
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cls, name)


class _Messages:
    """tierd_pb2 with every message class _Checked: the clients build each
    request from a caller's values through it."""

    def __getattr__(self, name: str) -> Any:
        attr = getattr(tierd_pb2, name)
        if isinstance(attr, type) and issubclass(attr, Message):
            attr = _Checked(attr)
        setattr(self, name, attr)  # looked up once
        return attr


pb: Any = _Messages()


def default_address() -> str:
    """TIERD_SOCKET if set, else the daemon's default socket. A client given no
    address connects here only through a directory of its own user."""
    path = os.environ.get("TIERD_SOCKET") or os.path.join(default_runtime_dir(), "tierd.sock")
    return "unix:" + os.path.abspath(path)


def _private_socket_dir(directory: str) -> None:
    """Refuse to connect through a socket directory that another user owns or
    can write to: they could stand in for the daemon and receive this client's
    token and KV (a local user can create /tmp/tierd-UID before the daemon
    first starts). Where it is missing, claim it (0700) as the daemon would:
    nobody else can make it later, and this user's daemon accepts it."""
    try:
        os.mkdir(directory, 0o700)
    except (FileExistsError, FileNotFoundError, PermissionError):
        pass  # there already, or a parent is missing or not ours to write: no one else's either
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return
    uid = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        problem = "is a symbolic link" if stat.S_ISLNK(st.st_mode) else "is not a directory"
    elif st.st_uid != uid:
        problem = f"belongs to uid {st.st_uid}, not to you (uid {uid})"
    elif st.st_mode & 0o022:
        problem = f"is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    else:
        return
    raise FailedPrecondition(f"the socket directory {directory} {problem}: whoever else controls it could stand in "
                             "for the daemon and receive your calls. Remove it if you do not know why it is there, "
                             "or give the daemon's address explicitly", directory=directory)


def _target(address: str | None) -> str:
    if address is None:
        target = default_address()
        _private_socket_dir(os.path.dirname(target[len("unix:"):]))
        return target
    if address.startswith(("unix:", "dns:", "ipv4:", "ipv6:")) or (":" in address and not address.startswith("/")):
        return address
    return "unix:" + os.path.abspath(address)


def _read(path_or_pem: str | bytes | None) -> bytes | None:
    if path_or_pem is None or isinstance(path_or_pem, bytes):
        return path_or_pem
    with open(path_or_pem, "rb") as f:
        return f.read()


def channel_args(address: str | None, token: str | None, tls_ca: Any, tls_cert: Any,
                  tls_key: Any) -> tuple[str, tuple, grpc.ChannelCredentials | None]:
    target = _target(address)
    token = token if token is not None else os.environ.get("TIERD_TOKEN") or None
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    creds = None
    if tls_ca is not None or tls_cert is not None:
        creds = grpc.ssl_channel_credentials(_read(tls_ca), _read(tls_key), _read(tls_cert))
    return target, metadata, creds
