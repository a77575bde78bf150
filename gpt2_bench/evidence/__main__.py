"""``python -m gpt2_bench.evidence run | queue | rebuild``: the command line of the loss evidence
(:mod:`gpt2_bench.evidence`: the protocol, the runs and the queue; :mod:`gpt2_bench.evidence.report`: the verdicts
and the files ``rebuild`` writes)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from gpt2_bench import evidence
from gpt2_bench.evidence import report


def main(argv: Optional[Sequence[str]] = None) -> int:
    rows_default = evidence.ROWS.relative_to(evidence.ROOT)
    parser = argparse.ArgumentParser(prog="python -m gpt2_bench.evidence",
                                     description=evidence.__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    places = argparse.ArgumentParser(add_help=False)  # where run and queue keep what they make
    places.add_argument("--work", default="bench_out/evidence",
                        help="logs and checkpoints (default bench_out/evidence)")
    places.add_argument("--rows", default=str(evidence.ROWS), help=f"where the curve files go (default {rows_default})")
    go = sub.add_parser("run", parents=[places],
                        help="train or resume one run of the protocol, keeping its curve in docs/rows/evidence")
    go.add_argument("method", choices=sorted(evidence.METHODS))
    go.add_argument("--seed", type=int, required=True)
    go.add_argument("--batch", default="1x", choices=sorted(evidence.BATCHES))
    go.add_argument("--lr", default="1e-3", help="the peak learning rate as written in the file name (default 1e-3)")
    go.add_argument("--in-one", action="store_true",
                    help="(what every run does now; kept so that the commands earlier curve files record still run)")
    go.epilog = ("after --: trainer arguments for where it runs, e.g. -- --device cuda-shared --dataset "
                 ".gpu/data/mix --max-time 420")
    line = sub.add_parser("queue", parents=[places],
                          help="run the queue's unfinished runs in order, one at a time, resuming each")
    line.add_argument("--list", action="store_true",
                      help="print the unfinished runs in order, how far each is and, for a method in progress, "
                           "its gap to plain's kept curve at their newest shared evaluation; then stop")
    sub.add_parser("rebuild", help="remake docs/evidence.md, its plot and the README's quality block")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.extra = argv[cut + 1:]
    if args.extra and args.command != "run":
        parser.error("trainer arguments after -- go with the run command only")
    if args.command == "run":
        try:
            float(args.lr)
        except ValueError:
            parser.error(f"--lr takes a number such as 1e-3, got {args.lr!r}")
        evidence.run(args.method, args.seed, args.batch, args.lr, Path(args.work), Path(args.rows), args.extra)
    elif args.command == "queue" and args.list:
        lines = evidence.progress(Path(args.rows), evidence.cpu_platform(), Path(args.work))
        print("\n".join(lines) or "the queue is done")
    elif args.command == "queue":
        evidence.queue(Path(args.work), Path(args.rows))
    else:
        report.rebuild()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
