"""How every compare mode runs its trainings: restarts, pooled step times, and the quality runs
(unshaped, checkpointed, read back or resumed when their settings match)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from gpt2_bench.config import TrainConfig
from gpt2_bench.launch import run, summarise
from gpt2_bench.methods import method_config

RUN_ATTEMPTS = 3
"""Every run the compare makes is started again if a rank dies (twice at most): see :func:`gpt2_bench.launch.run`."""

QUALITY_CHECKPOINTS = 6
"""A quality run checkpoints this many times, so a crash costs at most a sixth of it."""
QUALITY_KEPT_CHECKPOINTS = 2
"""A quality run keeps its newest checkpoints only (a long run's full set fills a disk)."""

HOW_NOT_WHAT = ("checkpoint_dir", "checkpoint_every", "keep_checkpoints", "resume", "max_time_s", "stop_at",
                "group_timeout_s", "fault_step", "diagnostics")
"""Settings that change how a run is carried out, not its losses."""


def pooled_median(values: list[float]) -> float:
    """The median of steady step times pooled over rounds (the upper middle of an even count; NaN for none)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else float("nan")


def same_math(recorded: dict, wanted: dict) -> bool:
    """Whether two runs' settings give the same losses (they may differ in :data:`HOW_NOT_WHAT`).

    A setting the recorded run does not list was added to :class:`TrainConfig` after it ran:
    it ran with what is now that setting's default (a new setting's default keeps the old behaviour), except the
    codec settings ``tagc.hook()`` now fills in (``plain``, ``feedback``, ``feedback_decay``): a run from before them
    ran their neutral values (:data:`tagc.hooks.settings.NEUTRAL`).
    """
    from tagc.hooks.codec_registry import resolve_options
    from tagc.hooks.settings import NEUTRAL

    defaults = {**json.loads(TrainConfig().to_json()), **NEUTRAL}
    recorded = {**{k: defaults[k] for k in wanted if k not in recorded and k in defaults}, **recorded}

    def strip(settings: dict) -> dict:
        kept = {k: v for k, v in settings.items() if k not in HOW_NOT_WHAT}
        if kept.get("compression") != "none" and "codec" in kept:  # the options as the codec resolves them:
            try:  # an empty dict meant the codec's defaults, which are now named
                kept["codec_options"] = resolve_options(kept["codec"], kept.get("codec_options") or {})
            except ValueError:  # a codec or option this version does not know: compared as recorded
                pass
        return kept

    return strip(recorded) == strip(wanted)


def quality_runs(base: TrainConfig, methods: Sequence[str], steps: int, data_dir: str,
                 dense_steps: int | None = None, folder: Path | None = None,
                 configure: Callable[[TrainConfig, str], TrainConfig] | None = None) -> dict[str, dict]:
    """Each method once, unshaped, for ``steps`` steps: its loss does not depend on the link.
    ``dense_steps`` (default: the timed runs') is the error-feedback codecs' dense warm-up here.
    Returns each method's run summary (:func:`gpt2_bench.launch.summarise`).

    Runs live in ``<out_dir>/quality``, each beside the settings it ran with. A finished run
    with the same settings is read back instead of trained again, so the long quality runs are
    made once (in the background, or over several sessions) and the timed sweeps added later.
    An interrupted run (``<name>.started.json`` with the same settings) resumes from its newest
    checkpoint, with the same losses as an uninterrupted one. ``folder``: where the runs live
    (default ``<out_dir>/quality``). ``configure``: a method's settings from ``base`` (default
    :func:`~gpt2_bench.methods.method_config`; a layout's: :func:`~gpt2_bench.methods.layout_config`).
    """
    configure = configure or method_config
    eval_interval = max(1, steps // 15)  # from the steps alone: the timed runs' settings do not change it
    results = {}
    for method in methods:
        warm = base if dense_steps is None else dataclasses.replace(base, dense_steps=dense_steps)
        out = Path(base.out_dir) / "quality" if folder is None else Path(folder)
        cfg = dataclasses.replace(configure(warm, method), steps=steps, link="none", eval_interval=eval_interval,
                                  out_dir=str(out), checkpoint_dir=str(out / f"checkpoints-{method}"),
                                  checkpoint_every=max(1, steps // QUALITY_CHECKPOINTS),
                                  keep_checkpoints=QUALITY_KEPT_CHECKPOINTS)
        settings, log = out / f"{cfg.run_name}.config.json", out / f"{cfg.run_name}.jsonl"
        started = out / f"{cfg.run_name}.started.json"
        wanted = json.loads(cfg.to_json())
        if settings.exists() and log.exists() and same_math(json.loads(settings.read_text()), wanted):
            try:
                results[method] = summarise(cfg, log, "none")
                print(f"quality: {method}: reusing the finished run in {log}", file=sys.stderr)
                continue
            except (StopIteration, ValueError, KeyError):  # an unfinished log: train again
                pass
        settings.unlink(missing_ok=True)
        if started.exists() and same_math(json.loads(started.read_text()), wanted):
            # an interrupted run (a killed session): go on from its checkpoint
            cfg = dataclasses.replace(cfg, resume=True)
            print(f"quality: {method}: resuming the unfinished run from {cfg.checkpoint_dir}", file=sys.stderr)
        else:
            shutil.rmtree(cfg.checkpoint_dir, ignore_errors=True)  # another run's checkpoints must not be resumed
            out.mkdir(parents=True, exist_ok=True)
            started.write_text(cfg.to_json())
        results[method] = run(cfg, data_dir, link="none", attempts=RUN_ATTEMPTS)
        settings.write_text(cfg.to_json())
        started.unlink(missing_ok=True)
    return results


def seeded_quality_runs(base: TrainConfig, methods: Sequence[str], steps: int, data_dir: str, seeds: Sequence[int],
                        dense_steps: int | None = None) -> dict[int, dict[str, dict]]:
    """:func:`quality_runs` once per seed, each seed's runs in ``<out_dir>/quality/seed-<seed>``
    (read back, or resumed, as there): ``{seed: {method: result}}``."""
    return {seed: quality_runs(dataclasses.replace(base, seed=seed), methods, steps, data_dir, dense_steps,
                               folder=Path(base.out_dir) / "quality" / f"seed-{seed}") for seed in seeds}
