"""FSDP2 eager vs SimpleFSDP eager vs SimpleFSDP compiled, each plain and with TAGC.

``python -m gpt2_bench.integrations`` trains the same model on the same tokens six times on
an unshaped link (this compares the integrations' compute and memory, not the network) and
prints, side by side from one run: steady-state step time (median after the first fifth of
the steps, so compilation is excluded), its ratio to FSDP2 eager, peak resident memory
(the CPU stand-in for peak device memory; compiled runs include the compiler's own memory)
and the resident memory right after a steady-state forward (what forward leaves for
backward; resharding frees the blocks' gathered weights there).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from gpt2_bench.config import TrainConfig, build_parser, config_from_args
from gpt2_bench.launch import run

SETUPS = [  # (label, integration, compile)
    ("FSDP2 eager", "fsdp2", False),
    ("SimpleFSDP eager", "simple", False),
    ("SimpleFSDP compiled", "simple", True),
]


def measure(base: TrainConfig) -> list[dict]:
    """One run per setup and compression (none, then ``base.compression``)."""
    from gpt2_bench.data import prepare

    data_dir = str(prepare(base.dataset, base.cache_dir))
    rows = []
    for compression in ("none", base.compression):
        for label, integration, compiled in SETUPS:
            cfg = dataclasses.replace(base, integration=integration, compile=compiled, compression=compression,
                                      transport="gloo" if compression == "none" else "fair", link="none", name=None,
                                      keep_freed_memory=False)  # RSS after forward must show what resharding freed
            rows.append({"setup": label, **run(cfg, data_dir, link="none")})
    baseline = {row["compressed"]: row["iter_ms"] for row in rows if row["setup"] == "FSDP2 eager"}
    for row in rows:
        row["vs_fsdp2_eager"] = baseline[row["compressed"]] / row["iter_ms"]
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [
        "| setup | gradients | iter ms | speed-up vs FSDP2 eager | peak RSS MB | RSS after forward MB | val loss |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        grads = "plain (gloo reduce-scatter)" if row["algorithm"] == "fsdp" else f"TAGC {row['compressed']}"
        lines.append(f"| {row['setup']} | {grads} | {row['iter_ms']:.0f} | {row['vs_fsdp2_eager']:.2f}x | "
                     f"{row['peak_rss_mb']:.0f} | {row['forward_rss_mb']:.0f} | {row['val_loss']:.4f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Two bar panels, step time and memory after forward, plain and TAGC side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [label for label, _, _ in SETUPS]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, key, title in (
        (axes[0], "iter_ms", "steady-state step (ms)"),
        (axes[1], "forward_rss_mb", "RSS after forward (MB)"),
    ):
        for offset, (algorithm, colour) in enumerate((("fsdp", "tab:blue"), ("tagc", "tab:orange"))):
            values = [
                next(r[key] for r in rows if r["setup"] == label and r["algorithm"] == algorithm) for label in labels
            ]
            ax.bar([i + 0.4 * offset for i in range(len(labels))], values, width=0.4, color=colour,
                   label="plain" if algorithm == "fsdp" else "TAGC")
        ax.set_xticks([i + 0.2 for i in range(len(labels))], labels)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    parser.prog = "python -m gpt2_bench.integrations"
    parser.description = __doc__.split("\n\n")[0]
    parser.set_defaults(out_dir="bench_out/integrations", steps=15, block_size=128, eval_interval=10**6,
                        dense_steps=0)  # timing: every step compressed (no warm-up), as it always was
    parser.add_argument("--json", default=None, help="write the result rows (a JSON list) here")
    args = parser.parse_args(argv)
    base = config_from_args(args)
    if base.compression == "none":
        parser.error("--compression must be all or non-attn here (the plain rows are always run)")
    rows = measure(base)
    table = format_table(rows)
    print(
        f"preset {base.preset}, {base.world} ranks, {base.steps} steps of {base.batch_size}x{base.block_size} tokens, "
        f"unshaped loopback\n\n{table}"
    )
    out = Path(base.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot(rows, out / "integrations.png")
    (out / "report.md").write_text(
        f"# Integrations: step time and memory\n\n{table}\n\n![integrations](integrations.png)\n"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps([{k: v for k, v in r.items() if k != "curve"} for r in rows], indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
