"""The methods' report pieces every compare mode shares: the methods table, the verdict, the
share's arithmetic, the quality runs' report and the plots."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gpt2_bench.compare_figures import LOSS_TOLERANCE, explain_gap, no_worse_loss, val_loss_vs_fsdp, winner
from gpt2_bench.compare_rows import Loss, Row


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


def format_quality_report(quality: dict[str, Loss], steps: int, plateau: float | None = None) -> str:
    """The quality runs as Markdown: each method's val loss at every evaluation step, against
    fsdp's at the same step, and the final verdict per method; with ``plateau`` (the unigram
    loss, :meth:`gpt2_bench.data.TokenData.unigram_loss`), how far below it plain fell."""
    relative = {method: dict(points) for method, points in
                val_loss_vs_fsdp({method: loss.curve for method, loss in quality.items()}).items()}
    evals = {method: {c["step"]: c["val_loss"] for c in loss.curve if c.get("val_loss") is not None}
             for method, loss in quality.items()}
    methods = list(evals)
    lines = [f"# GPT-2: val loss of the quality runs ({steps} steps, unshaped)", ""]
    plain = quality["fsdp"].val_loss if "fsdp" in quality else None
    if plateau is not None:
        where = (f"; fsdp ends at {plain:.4f}, {plateau - plain:.2f} nats below it" if plain is not None else "")
        lines += [(f"Unigram plateau (val tokens under the train split's token frequencies): {plateau:.4f}{where}. "
                   f"Methods part only past it."), ""]
    steps_seen = sorted({step for curve in evals.values() for step in curve})
    if steps_seen:
        lines += ["| step | " + " | ".join(methods) + " |", "|---:|" + "---:|" * len(methods)]
        for step in steps_seen:
            cells = []
            for method in methods:
                value = evals[method].get(step)
                percent = relative.get(method, {}).get(step) if method != "fsdp" else None
                cells.append("" if value is None else
                             f"{value:.4f}" + (f" ({percent:+.2f}%)" if percent is not None else ""))
            lines.append(f"| {step} | " + " | ".join(cells) + " |")
        lines.append("")
    for method, loss in quality.items():
        text = f"- `{method}`: val loss {loss.val_loss:.4f}"
        if plain is not None and method != "fsdp":
            delta = loss.val_loss / plain - 1
            within = "within" if delta <= LOSS_TOLERANCE else "outside"
            text += f", {delta:+.2%} against fsdp: {within} {LOSS_TOLERANCE:.0%}"
        lines.append(text)
    lines += ["", "![losses](losses.png)", ""]
    return "\n".join(lines)


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


def plot_method_losses(curves: dict[str, list[dict]], path: Path) -> None:
    """Every method's training loss and val loss against step (``curves``: method -> its loss curve);
    with ``fsdp`` among them, also each val loss relative to fsdp's at the same step (long runs part
    by a few percent, which the absolute curves hide)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = _label_colors(list(curves))
    relative = val_loss_vs_fsdp(curves)
    fig, axes = plt.subplots(1, 3 if relative else 2, figsize=(16 if relative else 11, 4))
    train_ax, val_ax = axes[0], axes[1]
    for method, curve in curves.items():
        train_ax.plot([c["step"] for c in curve], [c["loss"] for c in curve], label=method, color=colors[method],
                      lw=0.9)
        vals = [c for c in curve if c.get("val_loss") is not None]
        val_ax.plot([c["step"] for c in vals], [c["val_loss"] for c in vals], marker="o", label=method,
                    color=colors[method])
        if relative:
            axes[2].plot(*zip(*relative[method]), marker="o", label=method, color=colors[method])
    train_ax.set(xlabel="step", ylabel="training loss", title="training loss")
    val_ax.set(xlabel="step", ylabel="val loss", title="val loss")
    if relative:
        axes[2].axhspan(-1, 1, color="grey", alpha=0.12, label="within 1% of fsdp")
        axes[2].set(xlabel="step", ylabel="val loss vs fsdp's at the same step (%)", title="val loss against fsdp")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def method_curves(rows: Sequence[Row]) -> dict[str, list[dict]]:
    """Each method's loss curve, from its first row (a method's rows at every share share its quality run)."""
    curves: dict[str, list[dict]] = {}
    for row in rows:
        curves.setdefault(row.method, row.curve)
    return curves
