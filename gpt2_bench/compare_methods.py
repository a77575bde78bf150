"""The methods mode: every method a user would pick, on one engine and one link, at one or more shares.

``python -m gpt2_bench.compare --methods peers --shares 0.31,0.9 --quality-steps 300`` times every
method (:data:`gpt2_bench.methods.METHODS`) on each share's scaled link over ``--rounds`` rounds in
alternating order, takes each method's val loss from unshaped quality runs (or ``--loss-from``
another compare's rows; ``--timed-from`` reuses earlier timed rows), and writes ``methods.md`` with
a table and a verdict per share, a Pareto plot, the loss curves and, over several shares, the
speed-up against the share.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from gpt2_bench.compare_figures import add_method_columns
from gpt2_bench.compare_report import (
    SHARE_ARITHMETIC,
    format_methods_table,
    format_param_gather,
    format_share_arithmetic,
    format_verdict,
    method_curves,
    plot_method_losses,
    plot_pareto,
    plot_speedup_vs_share,
)
from gpt2_bench.compare_rows import Loss, Row, losses_from, losses_of, read_json, write_rows
from gpt2_bench.compare_runs import RUN_ATTEMPTS, pooled_median, quality_runs, seeded_quality_runs
from gpt2_bench.config import TrainConfig
from gpt2_bench.launch import run, scaled_link
from gpt2_bench.methods import method_config, round_order
from testbed.link import parse_rate


def time_methods(base: TrainConfig, methods: Sequence[str], share: float, rounds: int,
                 data_dir: str) -> tuple[list[Row], dict]:
    """Every method on one scaled link, ``rounds`` rounds, every other one in reverse order (so a
    drift over the session lands on every method alike); a method's step time is the median of
    its steady steps pooled over the rounds. Returns (one row per method, link info)."""
    cfg = dataclasses.replace(base, link_share=share)
    link_info = scaled_link(cfg, data_dir) if base.link == "scaled" else {"rate": base.link, "exchange_share": None}
    runs: dict[str, list[dict]] = {method: [] for method in methods}
    for round_index in range(rounds):
        for method in round_order(methods, round_index):
            out = Path(base.out_dir) / f"share-{share:g}" / f"round-{round_index + 1}"
            method_cfg = dataclasses.replace(method_config(cfg, method), out_dir=str(out))
            runs[method].append(run(method_cfg, data_dir, link=link_info["rate"], attempts=RUN_ATTEMPTS))
    rows = []
    for method in methods:
        results = runs[method]
        rows.append(Row.from_summary(
            results[-1], method=method, share=share, link=link_info["rate"], link_info=link_info, preset=base.preset,
            dense_steps=base.dense_steps, rounds=rounds,
            iter_ms=pooled_median([ms for result in results for ms in result["steady_iter_ms"]]),
            iter_ms_per_round=[result["iter_ms"] for result in results]))
    return rows, link_info


def timed_rows_from(path: str, methods: Sequence[str], preset: str) -> list[tuple[float, list[Row], dict]]:
    """Another compare's timed rows (``--json``), per share in their order, with each share's link:
    the report made again without timing again, e.g. once a longer run's losses arrive (``--loss-from``)."""
    rows = [Row.from_json(row) for row in read_json(path) if row.get("method") and row.get("iter_ms")]
    if not rows:
        raise ValueError(f"{path} holds no timed rows (write them with --json)")
    presets = {row.preset for row in rows if row.preset}
    if presets - {preset}:
        raise ValueError(f"--timed-from {path} was timed on preset {', '.join(sorted(presets))}: give --preset "
                         f"{min(presets)}")
    shares = list(dict.fromkeys(row.share for row in rows))
    found = []
    for share in shares:
        by_method = {row.method: row for row in rows if row.share == share}
        missing = [method for method in methods if method not in by_method]
        if missing:
            raise ValueError(f"--timed-from {path} has no rows for {', '.join(missing)} at share {share}; "
                             f"it has {', '.join(by_method)}")
        share_rows = [by_method[method] for method in methods]
        first = share_rows[0]
        link_info = first.link_info or {"rate": first.link, "exchange_share": share, "rate_bps": parse_rate(first.link),
                                        "timed_in": path}
        found.append((share, share_rows, link_info))
    return found


def methods_report(base: TrainConfig, methods: Sequence[str], shares: Sequence[float], rounds: int, quality_steps: int,
                   quality_dense_steps: int | None = None, loss_from: str | None = None,
                   timed_from: str | None = None, seeds: Sequence[int] | None = None) -> tuple[list[Row], str]:
    """Time every method at every share (and measure its loss once, unshaped); returns the rows and
    a Markdown report, with plots written next to it. ``timed_from`` takes the timed rows of an
    earlier compare instead of timing again (its shares, rounds, steps and dense warm-up). With
    ``seeds``, the quality runs are made at every seed and a method's val loss is their mean."""
    from gpt2_bench.data import prepare

    data_dir = str(prepare(base.dataset, base.cache_dir)) if quality_steps or not timed_from else ""
    quality: dict[str, Loss] | None = None
    if quality_steps and seeds:
        from gpt2_bench.quality import mean_quality

        by_seed = seeded_quality_runs(base, methods, quality_steps, data_dir, seeds, quality_dense_steps)
        quality = losses_of(mean_quality(by_seed))
    elif quality_steps:
        quality = losses_of(quality_runs(base, methods, quality_steps, data_dir, quality_dense_steps))
    if loss_from:
        quality = losses_from(loss_from)
        missing = [m for m in methods if m not in quality]
        if missing:
            raise ValueError(f"--loss-from {loss_from} has no val loss for {', '.join(missing)}")
    rows, sections = [], []
    timed = (timed_rows_from(timed_from, methods, base.preset) if timed_from else
             [(share, *time_methods(base, methods, share, rounds, data_dir)) for share in shares])
    if timed_from:
        shares = [share for share, _, _ in timed]
        first = timed[0][1][0]
        rounds = first.rounds if first.rounds is not None else rounds
        base = dataclasses.replace(base, steps=first.steps,
                                   dense_steps=base.dense_steps if first.dense_steps is None else first.dense_steps)
    for share, share_rows, link_info in timed:
        add_method_columns(share_rows, parse_rate(link_info["rate"]), quality)
        rows.extend(share_rows)
        title = f"Share {share:g}" if link_info.get("rate_bps") else f"Link {link_info['rate']}"
        sections.append(f"## {title}\n\n{format_share_arithmetic(link_info)}\n\n{format_methods_table(share_rows)}\n\n"
                        f"{format_verdict(share_rows)}\n")
    out = Path(base.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot_pareto(rows, out / "pareto.png")
    plot_method_losses(method_curves(rows), out / "losses.png")
    pictures = "![pareto](pareto.png)\n\n![losses](losses.png)\n"
    if len(shares) > 1:
        plot_speedup_vs_share(rows, out / "speedup_vs_share.png")
        pictures += "\n![speed-up against share](speedup_vs_share.png)\n"
    quality_dense = base.dense_steps if quality_dense_steps is None else quality_dense_steps
    runs = "one unshaped run" if not seeds else f"the mean of unshaped runs at seeds {seeds}"
    loss_source = (f"val loss from {loss_from} (its own runs: the loss does not depend on the link)" if loss_from else
                   f"val loss from {runs} of {quality_steps} steps per method (the loss does not depend on the link; "
                   f"error-feedback codecs dense for its first {quality_dense} steps)"
                   if quality else f"val loss from the timed runs ({base.steps} steps)")
    timed_in = f"; timed in {timed_from}" if timed_from else ""
    report = (f"# GPT-2: the methods users would pick, on one engine and one link\n\n"
              f"Model preset `{base.preset}`, {base.world} ranks, {base.batch_size}x{base.block_size or 'preset'} "
              f"tokens per rank and step, integration `{base.integration}`, seed {base.seed}; timed runs of "
              f"{base.steps} steps, {rounds} round(s) per share, every other round in reverse order, step time = "
              f"median of the steady steps pooled over rounds (dense warm-up steps excluded{timed_in}); "
              f"{loss_source}. TAGC and top-k at ratio {base.ratio:g}; "
              f"error-feedback codecs dense for the first {base.dense_steps} steps.\n\n"
              f"{format_param_gather(base.param_dtype, base.integration)}\n\n"
              f"`bytes model`: the speed-up if a method differed from fsdp only in its bytes on the link; "
              f"`bits/param`: wire bits per gradient element per rank and step (plain fp32 on 2 ranks: 16); "
              f"`codec ms`: encode + decode on the training thread per step.\n\n{SHARE_ARITHMETIC}\n\n"
              + "\n".join(sections) + "\n" + pictures)
    (out / "methods.md").write_text(report)
    return rows, report


def methods_main(parser: argparse.ArgumentParser, args: argparse.Namespace, base: TrainConfig,
                 methods: Sequence[str], shares: Sequence[float], seeds: Sequence[int] | None) -> int:
    """``python -m gpt2_bench.compare --methods ... [--shares ...] [--quality-steps N | --loss-from F]
    [--timed-from F]``: the methods report, printed and written, and ``--json`` rows."""
    if args.timed_from:
        try:
            timed_rows_from(args.timed_from, methods, base.preset)
        except (OSError, ValueError) as error:
            parser.error(str(error))
    rows, report = methods_report(base, methods, shares, args.rounds, args.quality_steps, args.quality_dense_steps,
                                  args.loss_from, args.timed_from, seeds)
    print(report)
    if args.json:
        write_rows(rows, args.json)
    print(f"\nreport: {Path(base.out_dir) / 'methods.md'}", file=sys.stderr)
    return 0
