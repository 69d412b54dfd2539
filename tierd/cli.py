"""The `tierd` command: `serve` runs the daemon; the other verbs talk to a
running one (ls, stat, drop, top, health, version); llama-front runs an
HTTP front for llama-server (tierd.adapters.llamaserver)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict
from typing import Any

from tierd import __version__
from tierd.errors import TierdError
from tierd.sizes import format_size


def _serve_parser(sub: Any) -> None:
    from tierd.config import FIELDS, parse_bool

    p = sub.add_parser("serve", help="run the daemon in the foreground")
    p.add_argument("--config", help="TOML file with settings (flags and TIERD_* override it)")
    for name, f in FIELDS.items():
        switch = f.metadata["parse"] is parse_bool  # --insecure-tcp alone means true; --flush-on-stop false works too
        more = {"action": "append"} if f.metadata["repeat"] else \
            {"nargs": "?" if switch else None, "const": "true" if switch else None}
        p.add_argument("--" + name.replace("_", "-"), dest=name, default=None, metavar=name.upper(),
                       help=f"{f.metadata['help']} (env TIERD_{name.upper()})", **more)


def _client(args: argparse.Namespace) -> Any:
    from tierd.client import Client

    return Client(args.address, token=args.token, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key)


def cmd_serve(args: argparse.Namespace) -> int:
    from tierd import config
    from tierd.daemon import StartupError, serve

    flags = {k: v for k, v in vars(args).items() if k in config.FIELDS}
    try:
        cfg = config.load(flags, config_file=args.config)
    except TierdError as exc:
        print(f"tierd: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return serve(cfg)
    except StartupError as exc:
        logging.getLogger("tierd").error("%s", exc)
        return 1


def _row(info: Any) -> str:
    return (f"{info.session_id:<32} {info.tier or '-':<7} {info.state:<8} {info.num_tokens:>9} "
            f"{format_size(info.size_bytes):>10} {'yes' if info.durable else 'no':<7} {info.model_id}")


def cmd_ls(args: argparse.Namespace) -> int:
    with _client(args) as c:
        sessions = c.list(all_tenants=args.all)
    if args.json:
        print(json.dumps([_jsonable(s) for s in sessions], indent=2))
        return 0
    print(f"{'SESSION':<32} {'TIER':<7} {'STATE':<8} {'TOKENS':>9} {'SIZE':>10} {'DURABLE':<7} MODEL")
    for s in sessions:
        print(_row(s))
    return 0


def _jsonable(info: Any) -> dict[str, Any]:
    d = asdict(info)
    d["spec"] = info.spec.to_dict()
    return d


def cmd_stat(args: argparse.Namespace) -> int:
    with _client(args) as c:
        info = c.stat(args.session)
    d = _jsonable(info)
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        for k, v in d.items():
            if k != "spec":
                print(f"{k:<12} {v}")
        print(f"{'spec':<12} {info.spec.to_json()}")
    return 0


def cmd_drop(args: argparse.Namespace) -> int:
    with _client(args) as c:
        c.drop(args.session)
    print(f"dropped {args.session}")
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    try:
        with _client(args) as c:
            status = c.health()
    except TierdError as exc:
        print(f"NOT SERVING: {type(exc).__name__}: {exc}")
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


def _bar(used: int, budget: int, width: int = 30) -> str:
    frac = min(1.0, used / budget) if budget else 0.0
    full = int(round(frac * width))
    return "[" + "#" * full + "." * (width - full) + f"] {frac * 100:5.1f}%"


def render_top(stats: dict[str, Any], previous: dict[str, Any] | None, interval: float) -> str:
    lines = [f"tierd {stats['version']}   sessions {stats['sessions']}   copy ops {stats['copy_ops']}   "
             + "  ".join(f"{k}={v}" for k, v in sorted(stats["backends"].items())), ""]
    lines.append(f"{'TIER':<7} {'USED':>10} {'BUDGET':>10} {'':<39} {'SESSIONS':>8} {'SHARED':>10}  BACKEND")
    for t in stats["tiers"]:  # SHARED: what pages sessions share would take more, stored once per session
        lines.append(f"{t.name:<7} {format_size(t.used):>10} {format_size(t.budget):>10} {_bar(t.used, t.budget):<39} "
                     f"{t.sessions:>8} {format_size(t.saved):>10}  {t.backend}")
    lines += ["", f"{'ROUTE':<16} {'NOW':>12} {'AVERAGE':>12} {'TOTAL':>10}"]
    for route in sorted(stats["moved_bytes"]):
        total = stats["moved_bytes"][route]
        before = (previous or {}).get("moved_bytes", {}).get(route, total)
        now = (total - before) / interval if previous else 0.0
        avg = stats["bandwidth"].get(route, 0.0)
        lines.append(f"{route:<16} {format_size(now) + '/s':>12} {format_size(avg) + '/s':>12} {format_size(total):>10}")
    return "\n".join(lines)


def cmd_top(args: argparse.Namespace) -> int:
    previous = None
    with _client(args) as c:
        try:
            while True:
                stats = c.stats()
                screen = render_top(stats, previous, args.interval)
                if args.once:
                    print(screen)
                    return 0
                sys.stdout.write("\x1b[H\x1b[2J" + screen + "\n\n(ctrl-c to quit)\n")
                sys.stdout.flush()
                previous = stats
                time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0


def cmd_llama_front(args: argparse.Namespace) -> int:
    from tierd.adapters.llamaserver import Front
    from tierd.adapters.llamaserver_http import serve
    from tierd.adapters.llamaserver_upstream import Upstream, check_slot_dir, wait_upstreams

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("tierd.llamaserver")
    try:
        check_slot_dir(args.slot_dir)  # before waiting on the upstreams: a refusal is at once
        upstreams = [Upstream(u, args.kv_settings, api_key=args.upstream_api_key) for u in args.upstream]
        wait_upstreams(upstreams, args.wait)
        front = Front(upstreams, args.slot_dir, _client(args), namespace=args.namespace)
        server = serve(front, args.host, args.port)
    except (ValueError, OSError) as exc:
        print(f"tierd llama-front: {exc}", file=sys.stderr)
        return 2
    log.info("llama-front on http://%s:%d: %d slots of %s, slot files in %s", args.host, server.server_port,
             len(front.slots), ", ".join(u.url for u in upstreams), front.slot_dir)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        front.close()
    return 0


def _llama_front_parser(sub: Any) -> None:
    p = sub.add_parser("llama-front", help="an HTTP front for llama-server whose conversations tierd holds")
    p.add_argument("--upstream", action="append", required=True,
                   help="a llama-server, http://HOST:PORT, started with --slot-save-path SLOT_DIR (repeat it for "
                        "more)")
    p.add_argument("--slot-dir", required=True, help="the upstreams' --slot-save-path (a tmpfs, say /dev/shm/x)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8090, help="port to listen on (default 8090; 0 picks one)")
    p.add_argument("--namespace", default="llama-server",
                   help="prefix of the sessions the conversations are stored as (default llama-server)")
    p.add_argument("--kv-settings", default="",
                   help="the upstreams' settings that change what the KV holds and /props does not show "
                        "(say \"-ctk q8_0 --rope-freq-base 1e6\"): part of the stored states' identity")
    p.add_argument("--upstream-api-key", help="the upstreams' --api-key, for the front's own calls")
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the upstreams to answer")
    p.add_argument("--log-level", default="info", help="debug, info, warning or error")
    for flag, helptext in (("--address", "tierd's socket path, unix:PATH or HOST:PORT"),
                           ("--token", "bearer token for tierd"), ("--tls-ca", "PEM CA bundle (TCP)"),
                           ("--tls-cert", "PEM client certificate"), ("--tls-key", "PEM client key")):
        p.add_argument(flag, help=helptext)


def cmd_version(args: argparse.Namespace) -> int:
    print(f"tierd {__version__}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierd", description="KV-cache tiering daemon")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    for name, helptext in (("ls", "list sessions"), ("stat", "show one session"), ("drop", "drop one session"),
                           ("top", "live view of tiers and moves"), ("health", "check that the daemon serves")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--address", help="socket path, unix:PATH or HOST:PORT (default: TIERD_SOCKET or the "
                                         "daemon's default socket)")
        p.add_argument("--token", help="bearer token (default: TIERD_TOKEN)")
        p.add_argument("--tls-ca", help="PEM CA bundle to check the daemon's TLS certificate (TCP)")
        p.add_argument("--tls-cert", help="PEM client certificate, for mutual TLS")
        p.add_argument("--tls-key", help="PEM client key, for mutual TLS")
        if name in ("stat", "drop"):
            p.add_argument("session")
        if name in ("ls", "stat"):
            p.add_argument("--json", action="store_true", help="print JSON")
        if name == "ls":
            p.add_argument("--all", action="store_true", help="every tenant's sessions (admin tokens)")
        if name == "top":
            p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
            p.add_argument("--once", action="store_true", help="print one screen and exit")
    _llama_front_parser(sub)
    sub.add_parser("version", help="print the version")
    return parser


COMMANDS = {"serve": cmd_serve, "ls": cmd_ls, "stat": cmd_stat, "drop": cmd_drop, "top": cmd_top,
            "health": cmd_health, "llama-front": cmd_llama_front, "version": cmd_version}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except TierdError as exc:
        print(f"tierd {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
