"""Plain FSDP against TAGC, all layers against non-attention layers, side by side in one run.

The command line only: the main job (no mode flag) is :mod:`gpt2_bench.compare_paper`'s, ``--methods``,
``--shares``, ``--layout`` and ``--hosts`` :mod:`gpt2_bench.compare_layout`'s.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gpt2_bench.methods import LAYOUTS, METHODS, PAPER_METHODS, PAPER_RATIO


def build_compare_parser() -> argparse.ArgumentParser:
    """The training command line (:func:`gpt2_bench.config.build_parser`) with the compare's defaults and flags."""
    from gpt2_bench.config import build_parser

    parser = build_parser()
    parser.prog = "python -m gpt2_bench.compare"
    parser.description = __doc__.split("\n\n")[0]
    # 60 steps of 4x128 tokens per rank; the dense warm-up is the library's (tagc.hook(): 10 steps for TAGC;
    # ``--dense-steps 0`` compresses from step 0, where error feedback spreads the early LM-head moves out).
    parser.set_defaults(link="scaled", out_dir="bench_out/compare", steps=60, block_size=128, eval_interval=20,
                        ratio=PAPER_RATIO)
    helps = {"ratio": "ratio of the paper's TAGC methods, the main job's TAGC runs and topk; default 10, the paper's "
                      "(tagc-int4 and topk-int4 run 4.5, topk-f8 1.2, the lean methods 7)",
             "param_dtype": "the parameter all-gather dtype of every method that gathers parameters (never a DDP "
                            "one), alike, and of the plain step the link is calibrated on. Default: fp32"}
    for action in parser._actions:
        action.help = helps.get(action.dest, action.help)
    parser.add_argument("--json", default=None, help="write the result rows (a JSON list) here")
    parser.add_argument("--layout", default="flat", choices=LAYOUTS,
                        help="flat (default): FSDP sharded over every rank; ddp: DDP on 2 emulated hosts x 1 rank "
                             "(torch's hooks and ours through tagc.ddp_hook); hsdp: FSDP2 HSDP on 2 x 2. Each is timed "
                             "on the link the flat compare calibrates for the share, beside flat FSDP on the same "
                             "hosts (gpt2_bench.compare_layout)")
    parser.add_argument("--flat-methods", default=None,
                        help="--layout ddp/hsdp: the flat-FSDP methods timed beside the layout's (comma-separated; "
                             "default: every flat method with one of the layout's codecs)")
    parser.add_argument("--methods", default="paper",
                        help=f"comma-separated methods: {', '.join(METHODS)}; 'peers' for all of them; "
                             f"default 'paper' ({', '.join(PAPER_METHODS)}, in the paper's table); with --layout: "
                             f"the layout's (default: all of them)")
    parser.add_argument("--shares", default=None,
                        help="comma-separated shares to sweep (e.g. 0.31,0.6,0.9): one scaled link per share, every "
                             "method timed on each")
    parser.add_argument("--rounds", type=int, default=2,
                        help="timing rounds per share, every other one in reverse (default 2)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gpt2_bench.compare``: parse the command line and run its mode."""
    parser = build_compare_parser()
    args = parser.parse_args(argv)
    if args.layout == "flat" and args.flat_methods:
        parser.error("--flat-methods goes with --layout ddp or hsdp")
    if args.layout != "flat" or args.methods != "paper" or args.shares or args.hosts > 1:
        from gpt2_bench.compare_layout import layout_main

        return layout_main(parser, args)
    from gpt2_bench.compare_paper import paper_main
    from gpt2_bench.config import config_from_args

    try:
        base = config_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    return paper_main(base, args.json)


if __name__ == "__main__":
    sys.exit(main())
