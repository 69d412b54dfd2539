"""python -m bench [--quick] [--json PATH] [--only NAME ...]"""

from __future__ import annotations

import argparse
import sys

from bench import (api, codecs, flood, fragment, index, llamacpp, llamaserver, prefix, recall, remote, resume, starts,
                   tick, tiers, trace, vllm_ttft)
from bench.common import table, write_json

SUITES = {"tiers": tiers.run, "fragment": fragment.run, "resume": resume.run, "api": api.run, "index": index.run,
          "tick": tick.run, "trace": trace.run, "flood": flood.run, "starts": starts.run, "remote": remote.run,
          "prefix": prefix.run, "codecs": codecs.run, "recall": recall.run, "vllm": vllm_ttft.run,
          "llamacpp": llamacpp.run, "llamaserver": llamaserver.run}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats (minutes on 2 cores)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--only", nargs="*", choices=sorted(SUITES), help="run only these suites")
    parser.add_argument("--plots", metavar="DIR", help="also draw PNG plots there (needs matplotlib)")
    parser.add_argument("--soak", type=float, metavar="SECONDS",
                        help="instead, run the soak: 16 clients for this long, RSS and open files sampled")
    args = parser.parse_args(argv)
    results = []
    if args.soak:
        from bench import soak

        results = soak.run(args.soak)
        print(table(results))
        if args.json:
            write_json(args.json, results)
        return 0
    for name, run in SUITES.items():
        if args.only and name not in args.only:
            continue
        print(f"running {name} ...", file=sys.stderr, flush=True)
        results += run(args.quick)
    print(table(results))
    if args.json:
        write_json(args.json, results)
    if args.plots:
        from bench import plots

        for path in plots.write(results, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
