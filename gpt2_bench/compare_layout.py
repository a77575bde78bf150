"""The timed compares: flat FSDP's methods side by side (``--methods``), and the layout as an axis (``--layout``).

``--methods M --shares S`` times the methods (:data:`gpt2_bench.methods.METHODS`) on each share's scaled link over
``--rounds`` rounds in alternating order and writes ``methods.md``; ``--layout ddp|hsdp`` times the layout's methods
(:data:`gpt2_bench.methods.LAYOUT_METHODS`) beside the flat ones with the same codecs, on emulated hosts joined by
the flat compare's link, and writes ``layout-<layout>.md``. A step time is the median of the steady steps pooled
over rounds; a val loss is its timed run's and decides nothing. docs/results.md, "Who wins at which share", and
docs/layout.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from gpt2_bench.compare_rows import RUN_ATTEMPTS, Row, add_method_columns, fmt, write_rows
from gpt2_bench.config import TrainConfig, param_gather
from gpt2_bench.launch import median, run, scaled_link
from gpt2_bench.methods import (
    FLAT_PEER,
    LAYOUT_BASELINES,
    LAYOUT_FIELDS,
    layout_config,
    parse_layout_methods,
    parse_methods,
    round_order,
)
from testbed.link import parse_rate

# ----------------------------------------------------------------------------- report pieces


def format_methods_table(rows: Sequence[Row], plain_method: str = "fsdp", bf16_method: str = "fsdp-bf16") -> str:
    """One share's methods: time, speed-ups (against ``plain_method`` and ``bf16_method``), bytes, codec time,
    loss and the parameters' all-gather dtype (``param gather``; ``-`` where the run gathers none, DDP, or the
    row does not say)."""
    lines = [(f"| method | compressed | iter ms | vs {plain_method} | vs {bf16_method} | bytes model | wire MB/step | "
              f"bits/param | codec ms | exposed ms | val loss | vs {plain_method} | param gather |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        wire = row.wire_bytes_per_step
        delta = row.val_loss_delta
        lines.append(
            f"| {row.method} | {row.compressed if row.algorithm != 'fsdp' else '-'} | {row.iter_ms:.0f} | "
            f"{fmt(row.speedup, '.2f', 'x')} | {fmt(row.speedup_vs_fsdp_bf16, '.2f', 'x')} | "
            f"{fmt(row.bytes_model, '.2f', 'x')} | {fmt(None if wire is None else wire / 1e6, '.2f')} | "
            f"{fmt(row.bits_per_param, '.2f')} | {fmt(row.codec_ms, '.0f')} | {fmt(row.exposed_ms, '.0f')} | "
            f"{row.val_loss:.4f} | {fmt(None if delta is None else 100 * delta, '+.2f', '%')} | "
            f"{row.param_dtype or '-'} |")
    return "\n".join(lines)


def format_param_gather(param_dtype: str | None, integration: str, layout: str = "flat") -> str:
    """The report's line on the parameter all-gathers: which dtype every method that gathers parameters used
    (the compare passes ``--param-dtype`` to all of them alike), and what the CPU computes with."""
    gathered = param_dtype or "fp32"
    who = {"flat": "every flat-FSDP method", "ddp": "every flat-FSDP method (DDP gathers no parameters)",
           "hsdp": "every flat-FSDP and HSDP method"}[layout]
    compute = "" if param_dtype is None else (" On the CPU SimpleFSDP upcasts the gathered bf16 weights to float32 "
                                              "for compute (the bf16-rounded weights, float32 products); FSDP2 and "
                                              "FSDP1 compute in bf16.")
    where = "" if integration == "simple" else f" (integration `{integration}`)"
    return (f"Parameter all-gathers: **{gathered}** for {who}, `fsdp` and `fsdp-bf16` included, and for the plain "
            f"step the link is calibrated on{where}.{compute}")


def format_share_arithmetic(link_info: dict) -> str:
    """How the scaled link gives the plain exchange its share of a step."""
    if not link_info.get("rate_bps"):
        return f"- link {link_info['rate']} (not scaled)"
    share = link_info["exchange_share"]
    if link_info.get("share_of") == "link":
        what = (f"the link-bound time of a non-overlapped plain step (exchange and all-gathers) is {share:.0%} of it; "
                f"the plain exchange alone is {link_info['modelled_exchange_share']:.0%} (it cannot take {share:.0%} "
                f"here, since the all-gathers cross the same link)")
    else:
        what = f"the plain exchange is {share:.0%} of a non-overlapped plain step"
    return (f"- share {share:g}: a plain step computes {link_info['rest_ms']:.0f} ms here; the link is "
            f"{link_info['rate']} (10gbit / {link_info['slowdown']:.0f}), at which {what} (first guess "
            f"{link_info['first_guess']} gave the exchange {link_info['first_guess_share']:.0%}).")


# ----------------------------------------------------------------------------- timing and the reports


def time_layout(base: TrainConfig, layout: str, methods: Sequence[str], flat_methods: Sequence[str], share: float,
                rounds: int, data_dir: str) -> tuple[list[Row], dict]:
    """Every method of ``layout`` and of flat FSDP (``flat_methods``) on the share's link (on the layout's emulated
    hosts; ``flat``: on ``base``'s), ``rounds`` rounds in alternating order. Returns (rows, each with its
    ``layout``; link info)."""
    cfg = dataclasses.replace(base, link_share=share)
    hosts = {key: LAYOUT_FIELDS[layout][key] for key in ("hosts", "world") if key in LAYOUT_FIELDS[layout]}
    link_info = (scaled_link(dataclasses.replace(cfg, world=hosts.get("world", cfg.world)), data_dir)
                 if base.link == "scaled" else {"rate": base.link, "exchange_share": None})
    rate = link_info["rate"]
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
    rows = [Row.from_summary(results[-1], method=method, layout=which, param_dtype=gathers[(which, method)],
                             share=share, link=rate, link_info=link_info, preset=base.preset,
                             dense_steps=base.dense_steps, rounds=rounds,
                             iter_ms=median([ms for result in results for ms in result["steady_iter_ms"]]),
                             iter_ms_per_round=[result["iter_ms"] for result in results])
            for (which, method), results in runs.items()]
    return rows, link_info


def _mb(row: Row) -> str:
    return fmt(None if row.wire_bytes_per_step is None else row.wire_bytes_per_step / 1e6, ".2f")


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


def layout_report(base: TrainConfig, layout: str, methods: Sequence[str], flat_methods: Sequence[str],
                  shares: Sequence[float], rounds: int) -> tuple[list[Row], str]:
    """Time the layout's methods and the flat ones at every share, set each against its own layout's baselines;
    returns the rows and a Markdown report (also ``<out_dir>/methods.md`` for ``flat``,
    ``<out_dir>/layout-<layout>.md`` otherwise)."""
    from gpt2_bench.data import prepare

    data_dir = str(prepare(base.dataset, base.cache_dir))
    rows, sections = [], []
    for share in shares:
        share_rows, link_info = time_layout(base, layout, methods, flat_methods, share, rounds, data_dir)
        layout_rows = [row for row in share_rows if row.layout == layout]
        flat_rows = [] if layout == "flat" else [row for row in share_rows if row.layout == "flat"]
        rate_bps = parse_rate(link_info["rate"])
        for which, which_rows in ((layout, layout_rows), ("flat", flat_rows)):
            add_method_columns(which_rows, rate_bps, *LAYOUT_BASELINES[which])
        rows += layout_rows + flat_rows
        title = f"## Share {share:g}" if link_info.get("rate_bps") else f"## Link {link_info['rate']}"
        if layout == "flat":
            sections.append(f"{title}\n\n{format_share_arithmetic(link_info)}\n\n{format_methods_table(layout_rows)}\n")
            continue
        hosts = LAYOUT_FIELDS[layout]
        sections.append(
            f"{title}\n\n{format_share_arithmetic(link_info)}\n\n"
            f"### {layout.upper()} on {hosts['hosts']} emulated hosts x {hosts['world'] // hosts['hosts']} rank(s)\n\n"
            f"{format_methods_table(layout_rows, *LAYOUT_BASELINES[layout])}\n\n"
            f"### Flat FSDP on the same hosts and link\n\n"
            f"{format_methods_table(flat_rows)}\n\n### Side by side: what the layout buys, what the codec buys\n\n"
            f"{format_beside(layout_rows, flat_rows, layout)}\n")
    loss_source = f"val loss from the timed runs ({base.steps} steps)"
    tokens = f"{base.batch_size}x{base.block_size or 'preset'} tokens per rank and step"
    timed = f"timed runs of {base.steps} steps, {rounds} round(s) per share"
    dense = f"error-feedback codecs dense for the first {base.dense_steps} steps"
    out = Path(base.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if layout == "flat":
        report = (f"# GPT-2: the methods users would pick, on one engine and one link\n\n"
                  f"Model preset `{base.preset}`, {base.world} ranks, {tokens}, integration `{base.integration}`, "
                  f"seed {base.seed}; {timed}, every other round in reverse order, step time = median of the steady "
                  f"steps pooled over rounds (dense warm-up steps excluded); {loss_source}. TAGC and top-k "
                  f"at ratio {base.ratio:g}; {dense}.\n\n{format_param_gather(base.param_dtype, base.integration)}\n\n"
                  f"`bytes model`: the speed-up if a method differed from fsdp only in its bytes on the link; "
                  f"`bits/param`: wire bits per gradient element per rank and step (plain fp32 on 2 ranks: 16); "
                  f"`codec ms`: encode + decode on the training thread per step. Where the shares come from: "
                  f"docs/results.md, \"Who wins at which share\".\n\n"
                  + "\n".join(sections))
        (out / "methods.md").write_text(report)
        return rows, report
    report = (f"# GPT-2: the {layout.upper()} layout against flat FSDP, on one link\n\n"
              f"Model preset `{base.preset}`, {tokens}, seed {base.seed}; {timed} in alternating order (the layout's "
              f"methods and the flat ones interleaved), step time = median of the steady steps pooled over rounds; "
              f"{loss_source}. TAGC and top-k at ratio {base.ratio:g} (the lean ones at theirs); {dense} (torch's "
              f"powerSGD_hook: start_powerSGD_iter {max(2, base.dense_steps + 1)}). The link of a share is calibrated "
              f"on the flat plain step (gpt2_bench.launch.scaled_link); every host's link runs at it.\n\n"
              f"{format_param_gather(base.param_dtype, base.integration, layout)}\n\n"
              f"`layout buys`: the flat method's step over the layout's with the same codec. Bytes: this rank's per "
              f"step (the hook's count; DDP's own all-reduce and torch's hooks: gpt2_bench.layout_ddp's count).\n\n"
              + "\n".join(sections))
    (out / f"layout-{layout}.md").write_text(report)
    return rows, report


LAYOUT_OUT_DIR = "bench_out/compare-layout"
"""Where a layout compare writes (its own folder: its flat rows run on emulated hosts)."""


def layout_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``python -m gpt2_bench.compare --methods ...`` (``args.layout`` flat) or ``--layout ddp|hsdp ...``."""
    from gpt2_bench.config import config_from_args

    layout = args.layout
    if layout != "flat" and (args.hosts > 1 or args.nproc_per_host):
        parser.error(f"--layout {layout} sets its own hosts ({LAYOUT_FIELDS[layout]}): "
                     f"leave out --hosts/--nproc-per-host")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    try:
        if layout == "flat":
            methods, flat_methods = parse_methods(args.methods), ()
        else:
            methods = parse_layout_methods(layout, None if args.methods == "paper" else args.methods)
            flat_methods = parse_layout_methods("flat", args.flat_methods)
        shares = [float(x) for x in args.shares.split(",")] if args.shares else [args.link_share]
        if layout != "flat" and args.out_dir == parser.get_default("out_dir"):
            args.out_dir = LAYOUT_OUT_DIR
        base = config_from_args(args)
        base = dataclasses.replace(base, world=LAYOUT_FIELDS[layout].get("world", base.world))
        for which, names in ((layout, methods), ("flat", flat_methods)):  # every run's settings, checked up front
            for method in names:
                layout_config(base, which, method, link="none")
    except ValueError as error:
        parser.error(str(error))
    rows, report = layout_report(base, layout, methods, flat_methods, shares, args.rounds)
    print(report)
    if args.json:
        write_rows(rows, args.json)
    print(f"\nreport: {Path(base.out_dir) / ('methods.md' if layout == 'flat' else f'layout-{layout}.md')}",
          file=sys.stderr)
    return 0
