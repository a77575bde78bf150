"""The quality-only mode: each method's val loss, unshaped, with no timed runs.

``python -m gpt2_bench.compare --quality-only --methods fsdp,tagc-non-attn --quality-steps 600`` runs
(or reads back, or resumes) each method's quality run and writes ``<out_dir>/quality/quality.md``
and its loss plot. With ``--seeds 0,1`` every method runs at every seed and the report
(:mod:`gpt2_bench.quality`) gives the mean gap to fsdp of the same seed against the seed-to-seed
spread.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from gpt2_bench.compare_figures import LOSS_TOLERANCE
from gpt2_bench.compare_report import format_quality_report, plot_method_losses
from gpt2_bench.compare_rows import losses_of
from gpt2_bench.compare_runs import quality_runs, seeded_quality_runs
from gpt2_bench.config import TrainConfig


def _preset_block_size(preset: str) -> int:
    from gpt2_bench.model import GPTConfig

    return GPTConfig.preset(preset).block_size


def quality_main(base: TrainConfig, methods: Sequence[str], steps: int, dense_steps: int | None,
                 seeds: Sequence[int] | None) -> int:
    """Run (or read back) the quality runs, print their report and write it with its plots."""
    from gpt2_bench.data import TokenData, prepare

    folder = Path(base.out_dir) / "quality"
    data_dir = str(prepare(base.dataset, base.cache_dir))
    if seeds is not None:
        from gpt2_bench import quality as protocol

        by_seed = seeded_quality_runs(base, methods, steps, data_dir, seeds, dense_steps)
        plateau = TokenData(prepare(base.dataset, base.cache_dir)).unigram_loss()
        tokens = base.batch_size * (base.block_size or _preset_block_size(base.preset)) * base.world
        report = protocol.format_seeds_report(by_seed, steps, plateau, tokens, LOSS_TOLERANCE)
        protocol.plot_seed_gaps(by_seed, folder / "gaps.png")
        first = by_seed[seeds[0]]
        plot_method_losses({method: result["curve"] for method, result in first.items()}, folder / "losses.png")
        report += f"\n![gaps](gaps.png)\n\n![losses, seed {seeds[0]}](losses.png)\n"
    else:
        quality = quality_runs(base, methods, steps, data_dir, dense_steps)
        plot_method_losses({method: result["curve"] for method, result in quality.items()}, folder / "losses.png")
        plateau = TokenData(prepare(base.dataset, base.cache_dir)).unigram_loss()
        report = format_quality_report(losses_of(quality), steps, plateau)
    (folder / "quality.md").write_text(report)
    print(report)
    print(f"report: {folder / 'quality.md'}", file=sys.stderr)
    return 0
