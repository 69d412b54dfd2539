"""`python -m bench.chaos --minutes M --seed S` (`make chaos MINUTES=60`):
one seeded campaign; its findings, then one summary line last. Exits 1 when
an invariant failed."""

from __future__ import annotations

import argparse
import json
import os
import sys

from bench.chaos.campaign import run
from bench.chaos.report import failed, summary


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the tally here too")
    ap.add_argument("--logs", default="bench/out/chaos-logs",
                    help="where the daemons' and Redis nodes' logs are kept when the campaign finds anything")
    args = ap.parse_args()
    campaign, model = run(args.seed, args.minutes * 60, os.environ.get("TIERD_BENCH_DIR"),
                          log=lambda line: print(line, flush=True), keep=args.logs)
    for (op, err), text in sorted(model.tally.samples.items()):
        print(f"first {err} of {op}: {text}")
    for finding in model.tally.findings:
        print("finding:", finding)
    line = summary(campaign, model)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"seed": args.seed, "minutes": args.minutes, "summary": line,
                       "findings": model.tally.findings}, f, indent=1)
    print(line, flush=True)
    return 1 if failed(campaign, model) else 0


if __name__ == "__main__":
    sys.exit(main())
