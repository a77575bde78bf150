"""The timed compares: flat FSDP's methods side by side (``--methods``), and the layout as an axis (``--layout``).

``python -m gpt2_bench.compare --methods peers --shares 0.31,0.9`` times every method a user would pick
(:data:`gpt2_bench.methods.METHODS`) on each share's scaled link over ``--rounds`` rounds in alternating order, and
writes ``methods.md`` (a table and a verdict per share: the fastest method within 1% of fsdp's val loss, TAGC's gap
split into bytes, codec time and loss), a Pareto plot and, over several shares, the speed-up against the share.
With ``--hosts H --nproc-per-host G`` (and a link rate) the same runs go on emulated hosts.

``python -m gpt2_bench.compare --layout ddp --shares 0.31,0.9`` times, at each share, every method of the layout
(:data:`gpt2_bench.methods.LAYOUT_METHODS`: DDP's own fp32 all-reduce, torch's ``bf16_compress_hook`` and
``powerSGD_hook``, and our codecs through ``tagc.ddp_hook``) and, beside them, the flat-FSDP methods with the same
codecs, on 2 emulated hosts x 1 rank (``--layout hsdp``: FSDP2 HSDP, 2 x 2) joined by the same link, the layout's
methods and the flat ones interleaved in one order; it writes ``layout-<layout>.md``. The link of a share is the
flat compare's: :func:`gpt2_bench.launch.scaled_link` calibrates it on the flat plain step (loopback, the layout's
world), and each host's link runs at that rate (:class:`testbed.hosts.EmulatedHosts`).

A method's step time is the median of its steady steps pooled over rounds. Losses come from the timed runs, or from
``--loss-from`` (another compare's rows; rows without a ``layout`` are flat). ``--timed-from`` reads the timed rows
of an earlier compare's ``--json`` instead of timing again (its shares, unless ``--shares`` picks some), and
``--flat-from`` the flat rows beside a layout's.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from gpt2_bench.compare_rows import (
    LOSS_TOLERANCE,
    RUN_ATTEMPTS,
    Loss,
    Row,
    add_method_columns,
    explain_gap,
    losses_from,
    no_worse_loss,
    pooled_median,
    read_json,
    winner,
    write_rows,
)
from gpt2_bench.config import TrainConfig, param_gather
from gpt2_bench.launch import run, scaled_link
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

SPEEDUP_TARGET = 3.0
"""Issue 38's target: the fastest method within 1% of the layout's plain val loss, this many times
faster per step than torch's DDP + ``bf16_compress_hook`` at share :data:`TARGET_SHARE`."""
TARGET_SHARE = 0.9
"""The share the target is set at (the verdict of another share names no target)."""


# ----------------------------------------------------------------------------- report pieces


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def other_length(row: Row) -> str:
    """`` (N steps)`` after a val loss from a run of another length than fsdp's (so not compared)."""
    return f" ({row.val_loss_steps} steps)" if row.val_loss_delta is None and row.val_loss_steps else ""


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
            f"{_fmt(row.speedup, '.2f', 'x')} | {_fmt(row.speedup_vs_fsdp_bf16, '.2f', 'x')} | "
            f"{_fmt(row.bytes_model, '.2f', 'x')} | {_fmt(None if wire is None else wire / 1e6, '.2f')} | "
            f"{_fmt(row.bits_per_param, '.2f')} | {_fmt(row.codec_ms, '.0f')} | {_fmt(row.exposed_ms, '.0f')} | "
            f"{row.val_loss:.4f}{other_length(row)} | {_fmt(None if delta is None else 100 * delta, '+.2f', '%')} | "
            f"{row.param_dtype or '-'} |")
    return "\n".join(lines)


def format_param_gather(param_dtype: str | None, integration: str, layout: str = "flat") -> str:
    """The report's line on the parameter all-gathers: which dtype every method that gathers parameters used
    (the compare passes ``--param-dtype`` to all of them alike), and what the CPU computes with."""
    gathered = param_dtype or "fp32"
    who = {"flat": "every flat-FSDP method", "ddp": "every flat-FSDP method (DDP gathers no parameters)",
           "hsdp": "every flat-FSDP and HSDP method"}[layout]
    compute = {None: "",
               "bf16": (" On the CPU SimpleFSDP upcasts the gathered bf16 weights to float32 for compute (the "
                        "bf16-rounded weights, float32 products); FSDP2 and FSDP1 compute in bf16."),
               "int8": (" Each rank's shard is quantized blockwise to int8 (one float32 scale per block) for the "
                        "all-gather and dequantized after it: compute uses the quantized weights, the sharded fp32 "
                        "master weights stay exact.")}.get(param_dtype, "")
    where = "" if integration == "simple" else f" (integration `{integration}`)"
    return (f"Parameter all-gathers: **{gathered}** for {who}, `fsdp` and `fsdp-bf16` included, and for the plain "
            f"step the link is calibrated on{where}.{compute}")


def format_verdict(rows: Sequence[Row]) -> str:
    """The share's winner, and where TAGC stands against it, ``fsdp`` and ``fsdp-bf16``."""
    best = winner(rows)
    by_method = {row.method: row for row in rows}
    lines = []
    if best is None:
        lines.append(f"- No method kept val loss within {LOSS_TOLERANCE:.0%} of fsdp's.")
    else:
        lines.append(f"- Fastest within {LOSS_TOLERANCE:.0%} of fsdp's val loss: **{best.method}** "
                     f"({best.iter_ms:.0f} ms, {best.speedup:.2f}x over fsdp"
                     + (f", {best.speedup_vs_fsdp_bf16:.2f}x over fsdp-bf16" if best.speedup_vs_fsdp_bf16 else "")
                     + f", val loss {100 * best.val_loss_delta:+.2f}%).")
    for name in ("tagc-non-attn", "tagc-all"):
        row = by_method.get(name)
        if row is None:
            continue
        text = f"- `{name}`: {row.speedup:.2f}x over fsdp" if row.speedup else f"- `{name}`"
        if row.speedup_vs_fsdp_bf16:
            text += f", {row.speedup_vs_fsdp_bf16:.2f}x over fsdp-bf16"
        if best is not None and best is not row:
            text += f"; against {best.method}: {explain_gap(row, best)}"
        faster = [other.method for other in rows if other is not row and other.iter_ms < row.iter_ms
                  and no_worse_loss(other, row)]
        text += f". Dominated by {', '.join(faster)} (faster, and no worse in loss)." if faster else ". Not dominated."
        lines.append(text)
    return "\n".join(lines)


SHARE_ARITHMETIC = (
    "Where the shares come from. **0.31** is the paper's: TAGC cut its exchange from 0.76 to 0.51 ms/MB (x0.67) and "
    "its iteration from 25.2 to 22.6, so the exchange was 2.6 / (1 - 0.67) = 7.9 of 25.2 units. **0.9** is an "
    "H100-class GPU over 10 GbE: GPT-2 (124M) on 16 x 1024 tokens per GPU is 6 x 124e6 x 16384 = 1.2e13 FLOP, "
    "30 ms at 400 TFLOP/s (40% of bf16 peak), while its fp32 gradient reduce-scatter moves ~(N-1)/N x 496 MB, "
    "~0.4 s at 1.25 GB/s, and its parameter all-gathers (bf16, forward and backward) ~0.4 s more: the link holds "
    "0.8 / 0.83 = 0.96 of a non-overlapped step, the reduce-scatter alone ~0.5. Here too the all-gathers cross the "
    "emulated link, so at 0.9 the link-bound time gets the share.")


def format_share_arithmetic(link_info: dict) -> str:
    """How the scaled link gives the plain exchange its share of a step."""
    if not link_info.get("rate_bps"):
        return f"- link {link_info['rate']} (not scaled)"
    if link_info.get("timed_in"):  # rows written before they carried their link's arithmetic
        return f"- share {link_info['exchange_share']:g}: link {link_info['rate']}; timed in {link_info['timed_in']}."
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


def _label_colors(methods: Sequence[str]) -> dict:
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return {method: cmap(i % 10) for i, method in enumerate(methods)}


def plot_pareto(rows: Sequence[Row], path: Path) -> None:
    """Step time against val loss, one point per method per share (lower left is better)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(row.method for row in rows))
    shares = sorted({row.share for row in rows})
    colors, markers = _label_colors(methods), "osD^v<>"
    fig, axes = plt.subplots(1, len(shares), figsize=(5.5 * len(shares), 4.2), squeeze=False)
    for ax, share in zip(axes[0], shares):
        for row in (r for r in rows if r.share == share):
            ax.scatter(row.iter_ms, row.val_loss, color=colors[row.method],
                       marker=markers[methods.index(row.method) % 7], s=50)
            ax.annotate(row.method + other_length(row), (row.iter_ms, row.val_loss), fontsize=7, xytext=(4, 3),
                        textcoords="offset points")
        ax.set(xlabel="median step (ms)", ylabel="val loss", title=f"share {share:g}: time against loss")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_speedup_vs_share(rows: Sequence[Row], path: Path) -> None:
    """One line per method: its speed-up over fsdp against the plain exchange's share of a step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(row.method for row in rows))
    colors = _label_colors(methods)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for method in methods:
        points = sorted((row.share, row.speedup) for row in rows if row.method == method and row.speedup)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=method, color=colors[method])
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set(xlabel="share of a non-overlapped plain step (the exchange's, or the link's past what it can take)",
           ylabel="speed-up over fsdp", title="speed-up against share")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
                             iter_ms=pooled_median([ms for result in results for ms in result["steady_iter_ms"]]),
                             iter_ms_per_round=[result["iter_ms"] for result in results])
            for (which, method), results in runs.items()]
    return rows, link_info


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
        lines.append(f"- No val losses (give --loss-from): the fastest method is "
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
                     f"{torch_powersgd.iter_ms:.0f} ms at the same rank ({torch_powersgd.iter_ms / ours.iter_ms:.2f}x);"
                     f" bytes per step {(ours.wire_bytes_per_step or 0) / 1e6:.3f} MB against "
                     f"{(torch_powersgd.wire_bytes_per_step or 0) / 1e6:.3f} MB.")
    return "\n".join(lines)


class MissingTimedRows(ValueError):
    """``--timed-from``'s file lacks a row the command asks for (a usage error, reported as one)."""


def timed_rows_from(path: str, layout: str, methods: Sequence[str], flat_methods: Sequence[str], preset: str,
                    shares: Sequence[float] | None = None) -> list[tuple[float, list[Row], dict]]:
    """The rows of an earlier compare's ``--json`` (the layout's ``methods`` and the flat ``flat_methods``), per share
    (``shares``, or the file's in their order) with its link, as :func:`time_layout` gives them; a missing method or
    another preset is a clear error."""
    rows = [Row.from_json(row) for row in read_json(path) if row.get("method") and row.get("iter_ms")]
    if not rows:
        raise MissingTimedRows(f"{path} holds no timed rows (write them with --json)")
    presets = {row.preset for row in rows if row.preset}
    if presets - {preset}:
        raise MissingTimedRows(f"--timed-from {path} was timed on preset {', '.join(sorted(presets))}: give --preset "
                               f"{min(presets)}")
    found = []
    for share in shares or dict.fromkeys(row.share for row in rows):
        by = {(row.layout or "flat", row.method): row for row in rows if row.share == share}
        wanted = [(layout, m) for m in methods] + [("flat", m) for m in flat_methods]
        missing = [f"{which} {m}" for which, m in wanted if (which, m) not in by]
        if missing:
            raise MissingTimedRows(f"--timed-from {path} has no rows for {', '.join(missing)} at share {share:g} "
                                   f"(it has {', '.join(sorted({m for _, m in by})) or 'none'})")
        share_rows = [by[entry] for entry in wanted]
        first = share_rows[0]
        found.append((share, share_rows, first.link_info or {"rate": first.link, "exchange_share": share,
                                                             "rate_bps": parse_rate(first.link), "timed_in": path}))
    return found


def _losses_only_from(rows: list[Row], losses: dict[str, Loss] | None) -> None:
    """Where the losses come from ``--loss-from``, a row without one keeps its timed run's loss marked with that run's
    length, so that it is never set against another run's loss (a gap of training, not of method)."""
    if losses:
        for row in rows:
            if row.method not in losses and row.val_loss_steps is None:
                row.val_loss_steps = row.steps


def layout_report(base: TrainConfig, layout: str, methods: Sequence[str], flat_methods: Sequence[str],
                  shares: Sequence[float], rounds: int, loss_from: str | None = None, flat_from: str | None = None,
                  timed_from: str | None = None) -> tuple[list[Row], str]:
    """Time the layout's methods and the flat ones at every share (or read them from ``timed_from``), set each
    against its own layout's baselines; returns the rows and a Markdown report (also ``<out_dir>/methods.md`` for
    ``flat``, ``<out_dir>/layout-<layout>.md`` otherwise)."""
    from gpt2_bench.data import prepare

    data_dir = "" if timed_from else str(prepare(base.dataset, base.cache_dir))
    losses = losses_from(loss_from) if loss_from else {}
    timed_flat = [] if flat_from else flat_methods
    timed = (timed_rows_from(timed_from, layout, methods, timed_flat, base.preset, shares) if timed_from else
             [(share, *time_layout(base, layout, methods, timed_flat, share, rounds, data_dir)) for share in shares])
    if timed_from:  # the header tells the timed runs' settings, not this command's defaults
        shares, first = [share for share, _, _ in timed], timed[0][1][0]
        base = dataclasses.replace(base, steps=first.steps or base.steps,
                                   dense_steps=base.dense_steps if first.dense_steps is None else first.dense_steps)
        rounds = first.rounds or rounds
    rows, sections = [], []
    for share, share_rows, link_info in timed:
        layout_rows = [row for row in share_rows if (row.layout or "flat") == layout]
        flat_rows = [] if layout == "flat" else ([row for row in share_rows if row.layout == "flat"]
                                                 or flat_rows_from(flat_from, flat_methods, share, base.param_dtype))
        rate_bps = parse_rate(link_info["rate"])
        for which, which_rows in ((layout, layout_rows), ("flat", flat_rows)):
            _losses_only_from(which_rows, losses.get(which))
            add_method_columns(which_rows, rate_bps, losses.get(which), *LAYOUT_BASELINES[which])
        rows += layout_rows + flat_rows
        title = f"## Share {share:g}" if link_info.get("rate_bps") else f"## Link {link_info['rate']}"
        if layout == "flat":
            sections.append(f"{title}\n\n{format_share_arithmetic(link_info)}\n\n{format_methods_table(layout_rows)}"
                            f"\n\n{format_verdict(layout_rows)}\n")
            continue
        hosts = LAYOUT_FIELDS[layout]
        timed_in = f" (timed in {flat_from})" if flat_from else ""
        sections.append(
            f"{title}\n\n{format_share_arithmetic(link_info)}\n\n"
            f"### {layout.upper()} on {hosts['hosts']} emulated hosts x {hosts['world'] // hosts['hosts']} rank(s)\n\n"
            f"{format_methods_table(layout_rows, *LAYOUT_BASELINES[layout])}\n\n"
            f"{format_layout_verdict(layout_rows, layout)}\n\n"
            f"### Flat FSDP on the same hosts and link{timed_in}\n\n"
            f"{format_methods_table(flat_rows)}\n\n### Side by side: what the layout buys, what the codec buys\n\n"
            f"{format_beside(layout_rows, flat_rows, layout)}\n")
    loss_source = f"val loss from {loss_from}" if loss_from else f"val loss from the timed runs ({base.steps} steps)"
    tokens = f"{base.batch_size}x{base.block_size or 'preset'} tokens per rank and step"
    timed = f"timed runs of {base.steps} steps, {rounds} round(s) per share"
    dense = f"error-feedback codecs dense for the first {base.dense_steps} steps"
    out = Path(base.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if layout == "flat":
        plot_pareto(rows, out / "pareto.png")
        pictures = "![pareto](pareto.png)\n"
        if len(shares) > 1:
            plot_speedup_vs_share(rows, out / "speedup_vs_share.png")
            pictures += "\n![speed-up against share](speedup_vs_share.png)\n"
        timed_in = f"; timed in {timed_from}" if timed_from else ""
        report = (f"# GPT-2: the methods users would pick, on one engine and one link\n\n"
                  f"Model preset `{base.preset}`, {base.world} ranks, {tokens}, integration `{base.integration}`, "
                  f"seed {base.seed}; {timed}, every other round in reverse order, step time = median of the steady "
                  f"steps pooled over rounds (dense warm-up steps excluded{timed_in}); {loss_source}. TAGC and top-k "
                  f"at ratio {base.ratio:g}; {dense}.\n\n{format_param_gather(base.param_dtype, base.integration)}\n\n"
                  f"`bytes model`: the speed-up if a method differed from fsdp only in its bytes on the link; "
                  f"`bits/param`: wire bits per gradient element per rank and step (plain fp32 on 2 ranks: 16); "
                  f"`codec ms`: encode + decode on the training thread per step.\n\n{SHARE_ARITHMETIC}\n\n"
                  + "\n".join(sections) + "\n" + pictures)
        (out / "methods.md").write_text(report)
        return rows, report
    timed_source = f"The timed rows are read from {timed_from} (timed there, not again).\n\n" if timed_from else ""
    report = (f"# GPT-2: the {layout.upper()} layout against flat FSDP, on one link\n\n"
              f"Model preset `{base.preset}`, {tokens}, seed {base.seed}; {timed} in alternating order (the layout's "
              f"methods and the flat ones interleaved), step time = median of the steady steps pooled over rounds; "
              f"{loss_source}. TAGC and top-k at ratio {base.ratio:g} (the lean ones at theirs); {dense} (torch's "
              f"powerSGD_hook: start_powerSGD_iter {max(2, base.dense_steps + 1)}). The link of a share is calibrated "
              f"on the flat plain step (gpt2_bench.launch.scaled_link); every host's link runs at it.\n\n"
              f"{timed_source}"
              f"{format_param_gather(base.param_dtype, base.integration, layout)}\n\n"
              f"`layout buys`: the flat method's step over the layout's with the same codec. Bytes: this rank's per "
              f"step (the hook's count; DDP's own all-reduce and torch's hooks: gpt2_bench.layout_ddp's count).\n\n"
              + "\n".join(sections))
    (out / f"layout-{layout}.md").write_text(report)
    return rows, report


LAYOUT_DEFAULTS = {"out_dir": "bench_out/compare-layout"}
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
        shares = ([float(x) for x in args.shares.split(",")] if args.shares else
                  None if args.timed_from else [args.link_share])
        if layout != "flat" and args.out_dir == parser.get_default("out_dir"):
            args.out_dir = LAYOUT_DEFAULTS["out_dir"]
        base = config_from_args(args)
        base = dataclasses.replace(base, world=LAYOUT_FIELDS[layout].get("world", base.world))
        for which, names in ((layout, methods), ("flat", flat_methods)):  # every run's settings, checked up front
            for method in names:
                layout_config(base, which, method, link="none")
    except ValueError as error:
        parser.error(str(error))
    try:
        rows, report = layout_report(base, layout, methods, flat_methods, shares, args.rounds, args.loss_from,
                                     args.flat_from, args.timed_from)
    except MissingTimedRows as error:
        parser.error(str(error))
    print(report)
    if args.json:
        write_rows(rows, args.json)
    print(f"\nreport: {Path(base.out_dir) / ('methods.md' if layout == 'flat' else f'layout-{layout}.md')}",
          file=sys.stderr)
    return 0
