"""Plain FSDP against TAGC, all layers against non-attention layers, side by side in one run.

``python -m gpt2_bench.compare`` trains the same model on the same tokens with the same seed
three times — uncompressed FSDP (the fair all-to-all reduce-scatter), TAGC on all layers and
TAGC on the non-attention linear layers — over the same emulated link, then prints the TAGC
paper's table beside ours, writes ``--json`` rows, loss-vs-step and loss-vs-time plots, a
timeline of one step and a Markdown report.

Every run overlaps each unit's exchange with the backward of the units before it (the
default); the plain run is also timed without overlap (``fsdp no-overlap``) to show what
overlap buys and to keep the link's calibration (the plain exchange's share of a
non-overlapped plain step). ``--no-overlap`` runs everything the old, blocking way.

Quality runs (``--quality-steps``, ``--quality-only``) measure each method's val loss unshaped.
For a decision, run them over seeds (``--seeds 0,1``): the report (:mod:`gpt2_bench.quality`)
gives every method's mean gap to fsdp of the same seed and the seed-to-seed spread at each
evaluation, and calls a gap inside the spread a tie. On ``--dataset mix`` a 2,000-step run reads
no token twice. The point at 4x the tokens per step is ``--batch-size 16`` (4x the default 4
windows per rank; one exchange per step, as a 4x larger global batch). ``--diagnostics`` logs the
per-step diagnostics of every run (:mod:`gpt2_bench.diagnostics`). A screening run is one seed
(``--seed``), resumed from its checkpoints like any quality run.

This module is the command line only: it parses the arguments and hands them to the mode's
module: :mod:`gpt2_bench.compare_paper` (the main job), :mod:`gpt2_bench.compare_methods`
(``--methods``, ``--shares``, ``--quality-steps``, ``--loss-from``, ``--timed-from``),
:mod:`gpt2_bench.compare_quality` (``--quality-only``), :mod:`gpt2_bench.compare_layout`
(``--layout ddp|hsdp``) and :mod:`gpt2_bench.compare_hosts` (``--hosts H``).

``--param-dtype bf16`` (or ``int8``, SimpleFSDP's blockwise gather) sets the parameter all-gather of every
method that gathers parameters alike (:mod:`gpt2_bench.methods`): no method has a gather of its own.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gpt2_bench.compare_hosts import HOST_METHODS, HOSTS_DEFAULTS, hosts_main
from gpt2_bench.config import TrainConfig
from gpt2_bench.methods import METHODS, PAPER_METHODS, PAPER_RATIO, parse_methods


def build_compare_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The training command line (:func:`gpt2_bench.config.build_parser`) with the compare's defaults and
    flags; with ``--hosts`` above 1 in ``argv``, the hosts compare's defaults (:data:`HOSTS_DEFAULTS`)."""
    from gpt2_bench.config import build_parser

    parser = build_parser()
    parser.prog = "python -m gpt2_bench.compare"
    parser.description = __doc__.split("\n\n")[0]
    # 60 steps of 4x128 tokens per rank (~15 min on 2 CPU cores); the dense warm-up is the library's (tagc.hook():
    # 10 steps for TAGC; ``--dense-steps 0`` to see plain top-k from step 0: +11% val loss at 30 steps, the early
    # LM-head moves that error feedback spreads out).
    parser.set_defaults(link="scaled", out_dir="bench_out/compare", steps=60, block_size=128, eval_interval=20,
                        ratio=PAPER_RATIO)
    ratio = next(action for action in parser._actions if action.dest == "ratio")
    ratio.help = ("ratio of the paper's TAGC methods (tagc-all, tagc-non-attn, tagc-ef21), of the main job's TAGC runs "
                  "and of topk; default 10, the paper's (tagc-int4 and topk-int4 run 4.5, topk-f8 1.2, the lean "
                  "methods 7)")
    param_dtype = next(action for action in parser._actions if action.dest == "param_dtype")
    param_dtype.help = ("the parameter all-gather dtype of every method that gathers parameters, alike: every "
                        "flat-FSDP method (fsdp and fsdp-bf16 included) and, with --layout hsdp, every HSDP one; "
                        "never a DDP one (DDP gathers none). bf16: torchtitan's MixedPrecisionPolicy("
                        "param_dtype=bf16, reduce_dtype=fp32); int8: SimpleFSDP's blockwise int8 gather (ZeRO++ "
                        "qwZ). The link of a share is calibrated on the plain step with the same gathers. "
                        "Default: fp32")
    hosts_probe = argparse.ArgumentParser(add_help=False)
    hosts_probe.add_argument("--hosts", type=int, default=1)
    if hosts_probe.parse_known_args(argv)[0].hosts > 1:  # emulated hosts: a short job per method on the tiny model
        parser.set_defaults(**HOSTS_DEFAULTS)
    parser.add_argument("--json", default=None, help="write the result rows (a JSON list) here")
    parser.add_argument("--layout", default="flat", choices=("flat", "ddp", "hsdp"),
                        help="flat (default): FSDP sharded over every rank; ddp: DDP on 2 emulated hosts x 1 rank "
                             "(torch's hooks and ours through tagc.ddp_hook); hsdp: FSDP2 HSDP on 2 x 2. Each is timed "
                             "on the link the flat compare calibrates for the share, beside flat FSDP on the same "
                             "hosts (gpt2_bench.compare_layout)")
    parser.add_argument("--flat-from", default=None,
                        help="--layout ddp/hsdp: take the flat-FSDP rows beside the layout's from an earlier layout "
                             "compare's --json instead of timing them again")
    parser.add_argument("--flat-methods", default=None,
                        help="--layout ddp/hsdp: the flat-FSDP methods timed beside the layout's (comma-separated; "
                             "default: every flat method with one of the layout's codecs)")
    parser.add_argument("--methods", default="paper",
                        help=f"comma-separated methods: {', '.join(METHODS)}; 'peers' for all of them; "
                             f"default 'paper' ({', '.join(PAPER_METHODS)}, in the paper's table). With --hosts: "
                             f"{', '.join(HOST_METHODS)} (default: all; defaults then {HOSTS_DEFAULTS})")
    parser.add_argument("--shares", default=None,
                        help="comma-separated shares to sweep (e.g. 0.31,0.6,0.9): one scaled link per share, every "
                             "method timed on each, and a speed-up-against-share plot")
    parser.add_argument("--rounds", type=int, default=2,
                        help="timing rounds per share, every other one in reverse (default 2)")
    parser.add_argument("--quality-steps", type=int, default=0,
                        help="measure each method's loss once, unshaped, over this many steps (0: from the timed "
                             "runs); finished runs with the same settings are read back")
    parser.add_argument("--loss-from", default=None,
                        help="take each method's val loss from another compare's --json rows (e.g. the small preset's "
                             "quality runs, for a timing-only sweep of gpt2-untied)")
    parser.add_argument("--timed-from", default=None,
                        help="take the timed rows (and their shares) from an earlier compare's --json instead of "
                             "timing again: its report made again, e.g. with --loss-from a longer run's losses")
    parser.add_argument("--quality-only", action="store_true",
                        help="run (or read back) the quality runs and print their val losses; no timed runs")
    parser.add_argument("--quality-dense-steps", type=int, default=None,
                        help="the quality runs' dense warm-up for error-feedback codecs (default: --dense-steps)")
    parser.add_argument("--seeds", default=None,
                        help="comma-separated seeds for the quality runs (e.g. 0,1): every method at every seed, each "
                             "seed's runs in quality/seed-<seed>; the report gives the mean gap to fsdp and the "
                             "seed-to-seed spread at every evaluation and calls a gap inside the spread a tie "
                             "(default: one run at --seed, in quality/)")
    return parser


def _flat_settings(parser: argparse.ArgumentParser, args: argparse.Namespace
                   ) -> tuple[tuple[str, ...], list[float], tuple[int, ...] | None, TrainConfig]:
    """The flat compare's methods, shares, quality seeds and run settings, checked (``parser.error`` otherwise)."""
    from gpt2_bench.config import config_from_args

    try:
        methods = parse_methods(args.methods)
        shares = [float(x) for x in args.shares.split(",")] if args.shares else [args.link_share]
    except ValueError as error:
        parser.error(str(error))
    if args.rounds < 1 or args.quality_steps < 0 or (args.quality_dense_steps or 0) < 0:
        parser.error("--rounds must be >= 1, --quality-steps and --quality-dense-steps >= 0")
    seeds = None
    if args.seeds is not None:
        from gpt2_bench.quality import parse_seeds

        try:
            seeds = parse_seeds(args.seeds)
        except ValueError as error:
            parser.error(str(error))
        if not args.quality_steps:
            parser.error("--seeds sets the quality runs' seeds: give --quality-steps too")
        if "fsdp" not in methods:
            parser.error("--seeds compares every method with fsdp's run of the same seed: add fsdp to --methods")
    return methods, shares, seeds, config_from_args(args)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gpt2_bench.compare``: parse the command line and run its mode."""
    parser = build_compare_parser(argv)
    args = parser.parse_args(argv)
    if args.layout != "flat":
        from gpt2_bench.compare_layout import layout_main

        return layout_main(parser, args)
    if args.flat_from or args.flat_methods:
        parser.error("--flat-from and --flat-methods go with --layout ddp or hsdp")
    if args.hosts > 1:
        return hosts_main(parser, args)
    methods, shares, seeds, base = _flat_settings(parser, args)
    if args.quality_only:
        if not args.quality_steps:
            parser.error("--quality-only needs --quality-steps")
        from gpt2_bench.compare_quality import quality_main

        return quality_main(base, methods, args.quality_steps, args.quality_dense_steps, seeds)
    if args.loss_from and args.quality_steps:
        parser.error("--loss-from and --quality-steps are two sources of the loss: give one")
    if args.timed_from and args.shares:
        parser.error("--timed-from brings its own shares: leave out --shares")
    if methods != PAPER_METHODS or args.shares or args.quality_steps or args.loss_from or args.timed_from:
        from gpt2_bench.compare_methods import methods_main

        return methods_main(parser, args, base, methods, shares, seeds)
    from gpt2_bench.compare_paper import paper_main

    return paper_main(base, args.json)


if __name__ == "__main__":
    sys.exit(main())
