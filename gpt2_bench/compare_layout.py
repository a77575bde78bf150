"""The layout as a first-class axis: DDP (or HSDP) against flat FSDP, on the same emulated hosts and link.

``python -m gpt2_bench.compare --layout ddp --shares 0.31,0.9 --quality-steps 300`` times, at each
share, every method of the layout (:data:`gpt2_bench.methods.LAYOUT_METHODS`: DDP's own fp32
all-reduce, torch's ``bf16_compress_hook`` and ``powerSGD_hook``, and our codecs through
``tagc.ddp_hook``) and, beside them, the flat-FSDP methods with the same codecs, on 2 emulated hosts
x 1 rank (``--layout hsdp``: FSDP2 HSDP, 2 x 2) joined by the same link, over ``--rounds`` rounds in
alternating order (the layout's methods and the flat ones interleaved in one order).

The link of a share is the flat compare's: :func:`gpt2_bench.launch.scaled_link` calibrates it on the
flat plain step (loopback, the layout's world), so the flat rows here are the flat compare's setting
and the layout's rows show what replicating instead of sharding buys on that link. Each host's link
runs at that rate (:class:`testbed.hosts.EmulatedHosts`).

Losses come from the quality runs (``--quality-steps``, unshaped, read back when finished): the
layout's runs on unshaped emulated hosts, the flat ones exactly the flat compare's
(:func:`gpt2_bench.compare_runs.quality_runs`), or from ``--loss-from`` (rows with a ``layout`` field; rows
without one are flat). ``--flat-from`` takes the flat rows from an earlier layout compare's
``--json`` instead of timing them again.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from gpt2_bench.compare_figures import LOSS_TOLERANCE, add_method_columns, winner
from gpt2_bench.compare_report import format_methods_table, format_param_gather, format_share_arithmetic
from gpt2_bench.compare_rows import Loss, Row, losses_of, read_json, write_rows
from gpt2_bench.compare_runs import RUN_ATTEMPTS, pooled_median, quality_runs
from gpt2_bench.config import TrainConfig, param_gather
from gpt2_bench.launch import run, scaled_link
from gpt2_bench.methods import (
    FLAT_PEER,
    LAYOUT_BASELINES,
    LAYOUT_FIELDS,
    layout_config,
    method_config,
    parse_layout_methods,
    round_order,
)
from testbed.link import parse_rate

SPEEDUP_TARGET = 3.0
"""Issue 38's target: the fastest method within 1% of the layout's plain val loss, this many times
faster per step than torch's DDP + ``bf16_compress_hook`` at share :data:`TARGET_SHARE`."""
TARGET_SHARE = 0.9
"""The share the target is set at (the verdict of another share names no target)."""


def time_layout(base: TrainConfig, layout: str, methods: Sequence[str], flat_methods: Sequence[str], share: float,
                rounds: int, data_dir: str) -> tuple[list[Row], dict]:
    """Every method of ``layout`` and of flat FSDP (``flat_methods``) on the share's link, on the layout's
    emulated hosts, ``rounds`` rounds in alternating order; a method's step time is the median of its
    steady steps pooled over rounds. Returns (rows, each with its ``layout``; link info)."""
    cfg = dataclasses.replace(base, link_share=share)
    calibration = dataclasses.replace(cfg, world=LAYOUT_FIELDS[layout]["world"])
    link_info = (scaled_link(calibration, data_dir) if base.link == "scaled"
                 else {"rate": base.link, "exchange_share": None})
    rate = link_info["rate"]
    hosts = {"hosts": LAYOUT_FIELDS[layout]["hosts"], "world": LAYOUT_FIELDS[layout]["world"]}
    entries = [("flat", m) for m in flat_methods] + [(layout, m) for m in methods]
    runs: dict[tuple[str, str], list[dict]] = {entry: [] for entry in entries}
    gathers: dict[tuple[str, str], str | None] = {}
    for round_index in range(rounds):
        for which, method in round_order(entries, round_index):
            method_cfg = layout_config(dataclasses.replace(cfg, link=rate, **hosts), which, method)
            gathers[(which, method)] = param_gather(method_cfg)
            out = Path(base.out_dir) / f"share-{share:g}" / f"round-{round_index + 1}" / which
            runs[(which, method)].append(run(dataclasses.replace(method_cfg, out_dir=str(out)), data_dir, link=rate,
                                             attempts=RUN_ATTEMPTS))
    rows = []
    for (which, method), results in runs.items():
        rows.append(Row.from_summary(
            results[-1], method=method, layout=which, param_dtype=gathers[(which, method)], share=share, link=rate,
            link_info=link_info,
            preset=base.preset, dense_steps=base.dense_steps, rounds=rounds,
            iter_ms=pooled_median([ms for result in results for ms in result["steady_iter_ms"]]),
            iter_ms_per_round=[result["iter_ms"] for result in results]))
    return rows, link_info


def layout_quality(base: TrainConfig, layout: str, methods: Sequence[str], flat_methods: Sequence[str], steps: int,
                   data_dir: str, dense_steps: int | None) -> dict[str, dict[str, Loss]]:
    """``{layout: {method: loss}}``: the quality runs of the layout (on unshaped emulated hosts) and the flat
    compare's own quality runs of ``flat_methods`` (read back where finished)."""

    def configure(cfg: TrainConfig, method: str) -> TrainConfig:
        return layout_config(cfg, layout, method, link="none")

    return {layout: losses_of(quality_runs(base, methods, steps, data_dir, dense_steps, configure=configure)),
            "flat": losses_of(quality_runs(base, flat_methods, steps, data_dir, dense_steps, configure=method_config))}


def losses_by_layout(path: str) -> dict[str, dict[str, Loss]]:
    """Another compare's ``--json`` val losses, ``{layout: {method: loss}}`` (rows without ``layout``: flat)."""
    found: dict[str, dict[str, Loss]] = {}
    for row in read_json(path):
        if row.get("method") and row.get("val_loss") is not None:
            found.setdefault(row.get("layout") or "flat", {})[row["method"]] = Loss(
                row["val_loss"], row.get("val_loss_steps") or row.get("steps"), row.get("preset"))
    if not found:
        raise ValueError(f"{path} holds no rows with a method and a val_loss (write one with --json)")
    return found


def flat_rows_from(path: str, flat_methods: Sequence[str], share: float, param_dtype: str | None = None) -> list[Row]:
    """The flat rows of share ``share`` in an earlier layout compare's ``--json``; rows that say they gathered
    their parameters in another dtype than ``param_dtype`` (``None``: fp32) are a clear error."""
    rows = {row["method"]: row for row in read_json(path)
            if row.get("layout") == "flat" and row.get("share") == share and row.get("iter_ms")}
    missing = [method for method in flat_methods if method not in rows]
    if missing:
        raise ValueError(f"--flat-from {path} has no flat rows for {', '.join(missing)} at share {share:g}")
    wanted = param_dtype or "fp32"
    other = sorted({rows[m]["param_dtype"] for m in flat_methods if rows[m].get("param_dtype") not in (None, wanted)})
    if other:
        raise ValueError(f"--flat-from {path}: its flat rows gathered their parameters in {', '.join(other)}, this "
                         f"compare in {wanted}: give the same --param-dtype")
    return [Row.from_json(rows[method]) for method in flat_methods]


def _mb(row: Row) -> str:
    return "-" if row.wire_bytes_per_step is None else f"{row.wire_bytes_per_step / 1e6:.2f}"


def format_beside(layout_rows: list[Row], flat_rows: list[Row], layout: str) -> str:
    """Each method of the layout beside the flat method with the same codec: step time, bytes per step,
    and what the layout buys (the flat method's step over the layout's)."""
    flat = {row.method: row for row in flat_rows}
    bf16 = flat.get("fsdp-bf16")
    lines = [(f"| {layout} method | iter ms | wire MB/step | flat method | flat iter ms | flat wire MB/step | "
              f"layout buys | vs flat fsdp-bf16 |"), "|---|---:|---:|---|---:|---:|---:|---:|"]
    for row in layout_rows:
        peer = flat.get(FLAT_PEER.get(row.method, ""))
        beside = (f"{peer.method} | {peer.iter_ms:.0f} | {_mb(peer)} | {peer.iter_ms / row.iter_ms:.2f}x | "
                  if peer else "- | - | - | - | ")
        lines.append(f"| {row.method} | {row.iter_ms:.0f} | {_mb(row)} | " + beside
                     + (f"{bf16.iter_ms / row.iter_ms:.2f}x |" if bf16 else "- |"))
    return "\n".join(lines)


def format_layout_verdict(rows: list[Row], layout: str) -> str:
    """The layout's winner against its bf16 baseline (the issue's 3x target), TAGC's place against torch's
    hooks, and our PowerSGD against torch's at the same rank."""
    plain, bf16_name = LAYOUT_BASELINES[layout]
    by_method = {row.method: row for row in rows}
    bf16 = by_method.get(bf16_name)
    best = winner(rows)
    lines = []
    if all(row.val_loss_delta is None for row in rows):
        fastest = min(rows, key=lambda row: row.iter_ms)
        over = bf16.iter_ms / fastest.iter_ms if bf16 else None
        lines.append(f"- No val losses (give --quality-steps or --loss-from): the fastest method is "
                     f"**{fastest.method}** ({fastest.iter_ms:.0f} ms"
                     + (f", {over:.2f}x over {bf16_name}" if over else "") + "), whatever its loss.")
    elif best is None:
        lines.append(f"- No method kept val loss within {LOSS_TOLERANCE:.0%} of {plain}'s.")
    else:
        over = bf16.iter_ms / best.iter_ms if bf16 else None
        lines.append(f"- Fastest within {LOSS_TOLERANCE:.0%} of {plain}'s val loss: **{best.method}** "
                     f"({best.iter_ms:.0f} ms, val loss {100 * best.val_loss_delta:+.2f}%)"
                     + (f": {over:.2f}x over {bf16_name}" if over else "")
                     + (f" (target {SPEEDUP_TARGET:g}x at share {TARGET_SHARE:g}: "
                        f"{'met' if over >= SPEEDUP_TARGET else 'not met'})"
                        if over and best.share in (None, TARGET_SHARE) else "") + ".")
    for name in ("tagc", "tagc-ef21", "tagc-lean"):
        row = by_method.get(name)
        if row is None:
            continue
        against = [f"{other.iter_ms / row.iter_ms:.2f}x over {other.method}"
                   for other in rows if other.method.startswith(f"{layout}-") and other is not row]
        delta = row.val_loss_delta
        lines.append(f"- `{name}`: {row.iter_ms:.0f} ms; " + ", ".join(against)
                     + ("" if delta is None else f"; val loss {100 * delta:+.2f}% against {plain}") + ".")
    ours, torch_powersgd = by_method.get("powersgd"), by_method.get(f"{layout}-powersgd")
    if ours and torch_powersgd:
        lines.append(f"- Our `powersgd` through tagc.ddp_hook: {ours.iter_ms:.0f} ms against torch's powerSGD_hook's "
                     f"{torch_powersgd.iter_ms:.0f} ms at the same rank "
                     f"({torch_powersgd.iter_ms / ours.iter_ms:.2f}x); bytes per step "
                     f"{(ours.wire_bytes_per_step or 0) / 1e6:.3f} MB against "
                     f"{(torch_powersgd.wire_bytes_per_step or 0) / 1e6:.3f} MB.")
    return "\n".join(lines)


class MissingTimedRows(ValueError):
    """``--timed-from``'s file lacks a row the command asks for (a usage error, reported as one)."""


def timed_rows_from(path: str, layout: str, methods: Sequence[str], flat_methods: Sequence[str],
                    share: float) -> tuple[list[Row], dict]:
    """The rows of share ``share`` in an earlier layout compare's ``--json`` (the layout's ``methods`` and the flat
    ``flat_methods`` it has) and their link, as :func:`time_layout` returns them; a missing method is a clear error."""
    found = [row for row in read_json(path) if row.get("share") == share and row.get("iter_ms")]
    by_layout = {which: {row["method"]: row for row in found if (row.get("layout") or "flat") == which}
                 for which in (layout, "flat")}
    missing = ([m for m in methods if m not in by_layout[layout]]
               + [f"flat {m}" for m in flat_methods if m not in by_layout["flat"]])
    if missing:
        raise MissingTimedRows(f"--timed-from {path} has no rows for {', '.join(missing)} at share {share:g} "
                         f"(it has {', '.join(by_layout[layout]) or 'none'} for {layout})")
    rows = ([Row.from_json(by_layout[layout][m]) for m in methods]
            + [Row.from_json(by_layout["flat"][m]) for m in flat_methods])
    return rows, by_layout[layout][methods[0]].get("link_info") or {"rate": rows[0].link, "exchange_share": None}


def _losses_only_from(rows: list[Row], losses: dict[str, Loss] | None) -> None:
    """Where the losses come from quality runs, a row without one keeps its timed run's loss marked with that run's
    length, so that it is never set against a quality run's loss (a gap of training, not of method)."""
    if losses:
        for row in rows:
            if row.method not in losses and row.val_loss_steps is None:
                row.val_loss_steps = row.steps


def layout_report(base: TrainConfig, layout: str, methods: Sequence[str], flat_methods: Sequence[str],
                  shares: Sequence[float], rounds: int, quality_steps: int, quality_dense_steps: int | None = None,
                  loss_from: str | None = None, flat_from: str | None = None,
                  timed_from: str | None = None) -> tuple[list[Row], str]:
    """Time the layout's methods and the flat ones at every share (or read them from ``timed_from``, an earlier
    layout compare's ``--json``), set each against its own layout's baselines; returns the rows and a Markdown
    report (also ``<out_dir>/layout-<layout>.md``)."""
    from gpt2_bench.data import prepare

    data_dir = str(prepare(base.dataset, base.cache_dir))
    quality = (layout_quality(base, layout, methods, flat_methods, quality_steps, data_dir, quality_dense_steps)
               if quality_steps else losses_by_layout(loss_from) if loss_from else {})
    timed_flat = [] if flat_from else flat_methods
    rows, sections = [], []
    for share in shares:
        share_rows, link_info = (timed_rows_from(timed_from, layout, methods, timed_flat, share) if timed_from else
                                 time_layout(base, layout, methods, timed_flat, share, rounds, data_dir))
        if timed_from:  # the header tells the timed runs' settings, not this command's defaults
            first = share_rows[0]
            base = dataclasses.replace(base, steps=first.steps or base.steps,
                                       dense_steps=base.dense_steps if first.dense_steps is None else first.dense_steps)
            rounds = first.rounds or rounds
        layout_rows = [row for row in share_rows if row.layout == layout]
        flat_rows = ([row for row in share_rows if row.layout == "flat"]
                     or flat_rows_from(flat_from, flat_methods, share, base.param_dtype))
        rate_bps = parse_rate(link_info["rate"])
        _losses_only_from(layout_rows, quality.get(layout))
        _losses_only_from(flat_rows, quality.get("flat"))
        add_method_columns(layout_rows, rate_bps, quality.get(layout), *LAYOUT_BASELINES[layout])
        add_method_columns(flat_rows, rate_bps, quality.get("flat"))
        rows += layout_rows + flat_rows
        title = f"Share {share:g}" if link_info.get("rate_bps") else f"Link {link_info['rate']}"
        hosts = LAYOUT_FIELDS[layout]
        timed_in = f" (timed in {flat_from})" if flat_from else ""
        sections.append(
            f"## {title}\n\n{format_share_arithmetic(link_info)}\n\n"
            f"### {layout.upper()} on {hosts['hosts']} emulated hosts x {hosts['world'] // hosts['hosts']} rank(s)\n\n"
            f"{format_methods_table(layout_rows, *LAYOUT_BASELINES[layout])}\n\n"
            f"{format_layout_verdict(layout_rows, layout)}\n\n"
            f"### Flat FSDP on the same hosts and link{timed_in}\n\n"
            f"{format_methods_table(flat_rows)}\n\n### Side by side: what the layout buys, what the codec buys\n\n"
            f"{format_beside(layout_rows, flat_rows, layout)}\n")
    timed_source = f"The timed rows are read from {timed_from} (timed there, not again).\n\n" if timed_from else ""
    loss_source = (f"val loss from {loss_from}" if loss_from else
                   f"val loss from unshaped quality runs of {quality_steps} steps (the layout's on unshaped emulated "
                   f"hosts, the flat ones the flat compare's)" if quality_steps else
                   f"val loss from the timed runs ({base.steps} steps)")
    report = (f"# GPT-2: the {layout.upper()} layout against flat FSDP, on one link\n\n"
              f"Model preset `{base.preset}`, {base.batch_size}x{base.block_size or 'preset'} tokens per rank and "
              f"step, seed {base.seed}; timed runs of {base.steps} steps, {rounds} round(s) per share in alternating "
              f"order (the layout's methods and the flat ones interleaved), step time = median of the steady steps "
              f"pooled over rounds; {loss_source}. TAGC and top-k at ratio {base.ratio:g} (the lean ones at theirs); "
              f"error-feedback codecs dense for the first {base.dense_steps} steps (torch's powerSGD_hook: "
              f"start_powerSGD_iter {max(2, base.dense_steps + 1)}). The link of a share is calibrated on the flat "
              f"plain step (gpt2_bench.launch.scaled_link); every host's link runs at it.\n\n"
              f"{timed_source}"
              f"{format_param_gather(base.param_dtype, base.integration, layout)}\n\n"
              f"`layout buys`: the flat method's step over the layout's with the same codec. Bytes: this rank's per "
              f"step (the hook's count; DDP's own all-reduce and torch's hooks: gpt2_bench.layout_ddp's count).\n\n"
              + "\n".join(sections))
    out = Path(base.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"layout-{layout}.md").write_text(report)
    return rows, report


LAYOUT_DEFAULTS = {"out_dir": "bench_out/compare-layout"}
"""Where a layout compare writes (its own folder: its flat rows run on emulated hosts)."""


def layout_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``python -m gpt2_bench.compare --layout ddp|hsdp ...``."""
    from gpt2_bench.config import config_from_args

    layout = args.layout
    if args.hosts > 1 or args.nproc_per_host:
        parser.error(f"--layout {layout} sets its own hosts ({LAYOUT_FIELDS[layout]}): "
                     f"leave out --hosts/--nproc-per-host")
    if args.seeds:
        parser.error("--seeds is not supported with --layout (the flat compare has it; or run the layout's quality "
                     "runs with the trainer and give their mean with --loss-from)")
    if args.quality_only:
        parser.error("--quality-only is not supported with --layout")
    if args.loss_from and args.quality_steps:
        parser.error("--loss-from and --quality-steps are two sources of the loss: give one")
    try:
        methods = parse_layout_methods(layout, None if args.methods == "paper" else args.methods)
        flat_methods = parse_layout_methods("flat", args.flat_methods)
        shares = [float(x) for x in args.shares.split(",")] if args.shares else [args.link_share]
    except ValueError as error:
        parser.error(str(error))
    if args.rounds < 1 or args.quality_steps < 0:
        parser.error("--rounds must be >= 1, --quality-steps >= 0")
    if args.out_dir == parser.get_default("out_dir"):
        args.out_dir = LAYOUT_DEFAULTS["out_dir"]
    try:
        base = dataclasses.replace(config_from_args(args), world=LAYOUT_FIELDS[layout]["world"])
        for which, names in ((layout, methods), ("flat", flat_methods)):  # every run's settings, checked up front
            for method in names:
                layout_config(base, which, method, link="none")
    except ValueError as error:
        parser.error(str(error))
    try:
        rows, report = layout_report(base, layout, methods, flat_methods, shares, args.rounds, args.quality_steps,
                                     args.quality_dense_steps, args.loss_from, args.flat_from, args.timed_from)
    except MissingTimedRows as error:
        parser.error(str(error))
    print(report)
    if args.json:
        write_rows(rows, args.json)
    print(f"\nreport: {Path(base.out_dir) / f'layout-{layout}.md'}", file=sys.stderr)
    return 0
