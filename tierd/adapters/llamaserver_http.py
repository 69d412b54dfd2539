"""The HTTP side of tierd's llama-server front (adapters/llamaserver.py):
its handler (the completion calls, COMPLETIONS, to the front with their
X-Tierd-Session, 1-200 of letters, digits and ._:@+=~-; its own calls
under /tierd/; slot actions refused, 403, as the front owns the slots and
their files; the rest relayed to the first upstream unchanged) and the relay of an answer
as it comes, server-sent events included, with llama-server's timings read
out of it. Runs in the front's process: a thread per HTTP connection."""

from __future__ import annotations

import json
import logging
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from tierd.adapters.llamaserver_upstream import Upstream

if TYPE_CHECKING:
    from tierd.adapters.llamaserver import Front

log = logging.getLogger("tierd.llamaserver")

COMPLETIONS = ("/completion", "/completions", "/v1/completions", "/chat/completions", "/v1/chat/completions",
               "/infill")
SESSION_HEADER = "X-Tierd-Session"
HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection", "te", "trailer",
       "upgrade"}
BODY_LIMIT = 64 << 20  # bytes of a request body


class FrontError(Exception):
    """A request the front refuses: its HTTP status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def auth(handler: BaseHTTPRequestHandler) -> dict[str, str]:
    value = handler.headers.get("Authorization")
    return {"Authorization": value} if value else {}


def relay(handler: BaseHTTPRequestHandler, upstream: Upstream, method: str, path: str, body: bytes | None,
          headers: dict[str, str]) -> dict[str, Any] | None:
    """Send the call to the upstream and its answer back as it comes
    (server-sent events included); returns the timings llama-server gave
    (the last event's, when streamed), None where it gave none."""
    conn = upstream.connect(timeout=None)  # a long generation is no error
    try:
        try:
            conn.request(method, path, body, headers)
            resp = conn.getresponse()
        except OSError as exc:
            raise FrontError(502, f"llama-server at {upstream.url}: {exc}") from None
        handler.answering = True  # type: ignore[attr-defined]  # an error from here on cannot be answered
        handler.send_response(resp.status)
        for name, value in resp.getheaders():
            if name.lower() not in HOP:
                handler.send_header(name, value)
        length = resp.getheader("Content-Length")
        if length is not None:
            data = resp.read()
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            handler.wfile.write(data)
            return timings_of(data)
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        tail = b""
        while chunk := resp.read1(1 << 16):
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            tail = (tail + chunk)[-(1 << 16):]
        handler.wfile.write(b"0\r\n\r\n")
        return timings_of(tail)
    finally:
        conn.close()


def timings_of(data: bytes) -> dict[str, Any] | None:
    """llama-server's timings in an answer: a JSON body, or the last server-sent event that has them."""
    for part in reversed([data] + data.split(b"\n")):
        text = part.strip()
        if text.startswith(b"data:"):
            text = text[5:].strip()
        if b'"timings"' not in text:
            continue
        try:
            found = json.loads(text).get("timings")
        except (ValueError, AttributeError):
            continue
        if isinstance(found, dict):
            return found
    return None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    front: Front  # set on the server's class
    answering = False  # the call's answer has begun

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _fail(self, status: int, message: str) -> None:
        data = json.dumps({"error": {"code": status, "message": message, "type": "tierd_front"}}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> bytes:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise FrontError(400, "Content-Length is not a number") from None
        if length < 0 or length > BODY_LIMIT:
            raise FrontError(413, f"a request body is at most {BODY_LIMIT} bytes")
        return self.rfile.read(length) if length else b""

    def _serve(self, method: str) -> None:
        front, path = self.front, urllib.parse.urlsplit(self.path).path
        self.answering = False  # (a connection's calls share the handler)
        try:
            body = self._body()
            if path == "/tierd/stats" and method == "GET":
                return self._json(200, front.stats())
            if path == "/tierd/prefetch" and method == "POST":
                sid = front.session_of(_field(body, "session"))
                front.prefetch(sid)  # type: ignore[arg-type]
                return self._json(202, {"session": sid})
            if path.startswith("/slots") and method != "GET":
                raise FrontError(403, "the tierd front owns the slots: their actions are its own")
            if path in COMPLETIONS and method == "POST":
                try:
                    request = json.loads(body)
                except ValueError:
                    raise FrontError(400, "the request body is not JSON") from None
                if not isinstance(request, dict):
                    raise FrontError(400, "the request body is not a JSON object")
                return front.complete(self, self.path, request, front.session_of(self.headers.get(SESSION_HEADER)))
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP and k.lower() != "host"}
            relay(self, front.upstreams[0], method, self.path, body or None, headers)
        except FrontError as exc:
            self._fail(exc.status, str(exc))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away
        except OSError as exc:  # llama-server went away
            self.close_connection = True
            if not self.answering:
                self._fail(502, f"llama-server: {exc}")

    def _json(self, status: int, value: Any) -> None:
        data = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # BaseHTTPRequestHandler's names
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_DELETE(self) -> None:
        self._serve("DELETE")


def _field(body: bytes, name: str) -> str:
    try:
        value = json.loads(body).get(name)
    except (ValueError, AttributeError):
        value = None
    if not isinstance(value, str):
        raise FrontError(400, f"the body is a JSON object with a string {name!r}")
    return value


def serve(front: Front, host: str, port: int) -> ThreadingHTTPServer:
    """The front's HTTP server, bound (serve_forever() runs it)."""
    handler = type("FrontHandler", (Handler,), {"front": front})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server
