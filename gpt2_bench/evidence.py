"""The loss evidence: the decision runs, their curves kept in ``docs/rows/evidence``, and the one command that
rebuilds every quality number of the README and ``docs/evidence.md`` from those files.

The protocol (``PROTOCOL``): GPT-2 ``small`` under DDP on 2 ranks, the ``mix`` corpus read without replacement
(:meth:`gpt2_bench.data.TokenData.train_batch`), one eval set of 131,072 val tokens shared by every seed, method and
batch (evaluated every 200 steps at 1x), and the same token budget at every batch: 2,000 steps of 1,024 tokens, 500
of 4,096, 125 of 16,384. A decision pairs a method with plain DDP of the same seed, batch and learning rate, run
where the arithmetic comes out the same (:func:`cpu_platform`: a CPU's runs are named by the machine's numerics
fingerprint and pair only within it, so a pair may span sessions on machines that share it; a GPU's, in bf16
autocast, keep ``-gpu`` files and pair only with each other, their seeds marked ``g``): each seed gives one gap (the
method's val loss over plain's, minus 1), and the verdict is the 95% t-interval of the mean gap over seeds. "Within
X%" means the interval's upper end is below X; an interval that holds 0 is a tie. Plain's learning rate is the one
of the sweep (``plain`` at several ``--lr``) with the lowest mean final loss, bracketed (a best at an end of the
sweep adds the rate one doubling past it, :data:`EDGE`), and every method is judged at it. A method whose settings
earlier screens picked on some seeds (:data:`TUNED_ON`) gets a second verdict over its other seeds alone. A method
exchanges every step after step 0 compressed, a resumed one too (the trainer settles DDP's buckets first); the runs
resumed before it did count their uncompressed steps (:func:`unsettled_resumes`, in the report), and the queue
makes them again.

``python -m gpt2_bench.evidence run METHOD --seed S [--batch 4x] [--lr 2e-3]`` trains one run in one process,
checkpointing at every evaluation, so that a stopped run resumes where it was (``--resume`` from its checkpoint),
and writes its curve file, to be committed at once;
``python -m gpt2_bench.evidence rebuild`` remakes ``docs/evidence.md``, its plot and the README's quality block;
``tests/test_evidence.py`` checks that they match the kept files.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
ROWS = ROOT / "docs" / "rows" / "evidence"
REPORT = ROOT / "docs" / "evidence.md"
PLOT = ROOT / "docs" / "img" / "evidence-gap.png"
README = ROOT / "README.md"
README_BEGIN, README_END = "<!-- evidence: python -m gpt2_bench.evidence rebuild -->", "<!-- /evidence -->"

PROTOCOL = ["--preset", "small", "--integration", "ddp", "--dataset", "mix", "--block-size", "128", "--world", "2",
            "--eval-tokens", "131072", "--threads", "1"]
TOKENS = 2000 * 4 * 128 * 2
"""The token budget of every run, whatever its batch."""
BATCHES = {"1x": 4, "4x": 16, "16x": 64}
"""Per-rank batch (windows of 128 tokens) at 1x, 4x and 16x the tokens per step."""
EVALUATIONS = 10
"""Evaluations per run, evenly spaced (every 200 steps at 1x)."""
LRS = ("5e-4", "1e-3", "2e-3")
"""Plain's learning-rate sweep."""
TAGC_FLAGS = ["--compression", "non-attn", "--codec", "tagc", "--feedback-decay-follows-lr"]
"""The trainer's flags for ``tagc.hook()`` + ``hook.follow_lr(optimizer)``; a variant of it adds its own."""
METHODS: dict[str, tuple[str, list[str]]] = {
    "plain": ("plain DDP", ["--compression", "none", "--transport", "gloo"]),
    "tagc": ("`tagc.hook()` + `hook.follow_lr(optimizer)`", TAGC_FLAGS),
    "tagc-brief": ("`tagc.hook(ratio=10, index_bits=1)`",
                   ["--compression", "non-attn", "--codec", "tagc", "--ratio", "10", "--index-bits", "1"]),
    "int4": ("`tagc.hook(codec=\"int4\", select=\"all\")`", ["--compression", "all", "--codec", "int4"]),
    "topk": ("`tagc.hook(codec=\"topk\")`", ["--compression", "non-attn", "--codec", "topk"]),
    "powersgd-r16": ("PowerSGD rank 16 (`tagc.hook(codec=\"powersgd\", rank=16)`)",
                     ["--compression", "all", "--codec", "powersgd", "--codec-option", "rank=16"]),
    "tagc-ratio2.25": ("`tagc.hook(ratio=2.25)` + `hook.follow_lr(optimizer)`", [*TAGC_FLAGS, "--ratio", "2.25"]),
}
"""The decision set, then a candidate fix for the gap that grows with the batch (at 4x on a CPU; at 16x on a GPU,
last): run name -> (what users call, the trainer's flags). ``tagc-ratio2.25`` sends twice ``tagc.hook()``'s bytes
per exchange, still half its bytes per token read at 4x the tokens per step: the fix the thirteenth screen of
``docs/quality-diagnosis.md`` points to."""
TUNED_ON: dict[str, tuple[int, ...]] = {"tagc": (0, 1), "topk": (0, 1), "powersgd-r16": (0,),
                                         "tagc-ratio2.25": (0, 1)}
"""The seeds whose model initialisation (``torch.manual_seed(seed)``, here as then) the earlier protocol's screens
picked a method's settings on: ratio 4.5, fading 0.9 and ``follow_lr``; ``topk``'s ratio 1.2 and float8 values;
PowerSGD's rank 16; ``tagc-ratio2.25``'s ratio on plain seed 1's weights, the rest as ``tagc`` (their windows were
drawn with replacement, so they differ from these). A method listed here gets a second verdict over its other seeds
alone."""
BEST = "best"
"""A queue item's learning rate meaning plain's best at its batch (:func:`best_lr`; 1e-3 until the sweep has one).
While the sweep's best is at one of its ends (:data:`EDGE`), the items at ``BEST`` of that batch wait."""
EDGE = "edge"
"""A queue item's learning rate meaning the rate one doubling past plain's best at its batch while that best is the
lowest or the highest rate swept (:func:`edge_lr`): a best at an end of the sweep is not yet bracketed. The item
drops out of the queue once the best is bracketed."""
QUEUE: tuple[tuple[str, int, str, str], ...] = (
    *(("plain", seed, "1x", lr) for seed in (0, 1) for lr in ("1e-3", "5e-4", "2e-3")),
    *(("plain", 0, "4x", lr) for lr in (*LRS, EDGE)),
    *((m, seed, "4x", BEST) for seed in (0, 1) for m in ("plain", "tagc", "topk")),
    *(("tagc-ratio2.25", seed, "4x", BEST) for seed in (0, 1)),
    *(("plain", seed, "1x", EDGE) for seed in (0, 1)),
    *((m, seed, "1x", BEST) for seed in (2, 3) for m in ("plain", "tagc", "topk")),
    *((m, seed, "1x", BEST) for m in ("tagc-brief", "powersgd-r16") for seed in (2, 3)),
    *(("int4", seed, "4x", BEST) for seed in (0, 1)),
    *(("plain", 0, "16x", lr) for lr in (*LRS, EDGE)),
    *((m, seed, "16x", BEST) for seed in (0, 1) for m in ("plain", "tagc", "int4", "topk")),
    *((m, seed, "1x", BEST) for seed in (0, 1) for m in ("tagc", "topk", "int4", "tagc-brief")),
)
"""The CPU's order of work (``queue``) from here on: each batch's learning-rate sweep, bracketed where its best is
at an end, before the methods judged at its best; ``tagc`` at 4x, where its gap was seen to grow, beside ``topk``
there and ``tagc`` at twice its bytes (the fixes the twelfth and thirteenth screens of
``docs/quality-diagnosis.md`` point to); then the seeds no setting was picked on (:data:`TUNED_ON`), which alone can
say whether ``topk`` should take ``tagc.hook()``'s place; then ``int4`` at 4x and 16x. Last, seeds 0 and 1 at 1x:
their first runs were kept with uncompressed resumes (:func:`unsettled_resumes`), and a new seed tells more than a
cleaner copy of one already read; there ``tagc-brief`` and the copies need plain again on this machine."""
GPT2_TOKENS_PER_STEP = 512 * 1024
"""GPT-2's tokens per step (512 sequences of 1,024 tokens): where the batch axis is read off."""
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131)
"""Student's t 0.975 quantile for 1 to 15 degrees of freedom (a 95% two-sided interval)."""


def schedule(batch: str) -> tuple[int, int]:
    """``(steps, eval interval)`` of ``batch`` at the fixed token budget."""
    if batch not in BATCHES:
        raise ValueError(f"batch must be one of {sorted(BATCHES)}, got {batch!r}")
    steps = TOKENS // (BATCHES[batch] * 128 * 2)
    return steps, steps // EVALUATIONS


def run_name(method: str, lr: str, platform: str = "cpu") -> str:
    """A run's file name: the method, its learning rate and, on a GPU, ``-gpu``: ``tagc-lr1e-3``."""
    return f"{method}-lr{lr}" + ("" if platform == "cpu" else f"-{platform}")


def curve_path(rows_dir: Path, method: str, seed: int, batch: str, lr: str, platform: str = "cpu") -> Path:
    """Where a run's curve file is kept: ``<rows_dir>/<batch>/seed-<seed>/<run name>.json``."""
    return rows_dir / batch / f"seed-{seed}" / f"{run_name(method, lr, platform)}.json"


def log_path(work: Path, method: str, seed: int, batch: str, lr: str, platform: str = "cpu") -> Path:
    """Where a run's trainer log is written: ``<work>/<batch>/seed-<seed>/<run name>.jsonl``."""
    return work / batch / f"seed-{seed}" / f"{run_name(method, lr, platform)}.jsonl"


def platform_of(extra: Sequence[str]) -> str:
    """``"gpu"`` where the trainer arguments ``extra`` put the run on CUDA (``--device cuda...``), else ``"cpu"``.
    The platforms keep apart: a GPU run (bf16 autocast) pairs only with plain on a GPU."""
    devices = [extra[i + 1] for i, arg in enumerate(extra[:-1]) if arg == "--device"]
    return "gpu" if devices and devices[-1].startswith("cuda") else "cpu"


def numerics_fingerprint(preset: str = "small", block_size: Optional[int] = 128, threads: int = 1) -> str:
    """How this machine's float arithmetic comes out, as 12 hex digits: a hash of ``preset``'s parameters after
    one AdamW step on fixed tokens (forward, backward, step) on ``threads`` threads (the evidence protocol's model
    by default, whatever model a run trains, so that it costs a second or two). Two machines of one image and
    torch can still differ in the last bits (the kernels torch and MKL pick follow the CPU's instruction set), and
    a training run amplifies that into differences as large as the gaps the evidence measures; a pair of runs is
    made where this fingerprint is the same. Leaves the caller's random state and thread count as they were."""
    import hashlib

    import torch

    from gpt2_bench.model import GPT, GPTConfig

    was = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = GPT(GPTConfig.preset(preset, **({"block_size": block_size} if block_size else {})))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            tokens = torch.randint(0, model.config.vocab_size, (2, model.config.block_size + 1))
            model(tokens[:, :-1], tokens[:, 1:])[1].backward()
            opt.step()
    finally:
        torch.set_num_threads(was)
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    return digest.hexdigest()[:12]


def cpu_platform() -> str:
    """This machine's CPU platform: ``cpu-`` and its :func:`numerics_fingerprint` under the protocol's model and
    threads; a CPU run pairs only with plain of the same fingerprint (the report's "One run on two machines").
    ``"cpu"`` alone names the runs made before fingerprints, all on one machine whose repeats agreed to the bit."""
    flags = dict(zip(PROTOCOL[::2], PROTOCOL[1::2]))
    return "cpu-" + numerics_fingerprint(threads=int(flags["--threads"]))


def on_cpu(kept: dict) -> bool:
    """Whether a curve file's run was made on a CPU (any fingerprint)."""
    return kept.get("platform", "cpu").startswith("cpu")


def trainer_argv(method: str, seed: int, batch: str, lr: str, out_dir: Path, checkpoint_dir: Path,
                 platform: str = "cpu") -> list[str]:
    """The trainer's arguments for one run of the protocol."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {method!r}")
    steps, interval = schedule(batch)
    return [*PROTOCOL, *METHODS[method][1], "--batch-size", str(BATCHES[batch]), "--steps", str(steps),
            "--eval-interval", str(interval), "--lr", lr, "--seed", str(seed), "--name", run_name(method, lr, platform),
            "--out-dir", str(out_dir), "--checkpoint-dir", str(checkpoint_dir), "--checkpoint-every", str(interval),
            "--keep-checkpoints", "1", "--resume"]


def keep(log: Path, rows: Path, method: str, seed: int, batch: str, lr: str, platform: str = "cpu") -> dict:
    """A trainer log -> its curve file: the sessions that made it (command, commit, torch, machine), the val loss at
    each evaluation, the train loss averaged over each evaluation's interval, the share of an epoch read, and the
    median bytes a step sent per rank (MB; so that a reader sees at what bytes each method was judged)."""
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    steps, interval = schedule(batch)
    losses = [(r["step"], r["loss"]) for r in records if "step" in r]
    train = [[end - 1, sum(v for s, v in losses if end - interval <= s < end) / interval]
             for end in range(interval, (max((s for s, _ in losses), default=-1) + 1) // interval * interval + 1,
                              interval)]
    done = 1 + max((s for s, _ in losses), default=-1)
    sessions = [r for r in records if "run" in r]
    other = {r["machine"].get("numerics") for r in sessions} - {platform.removeprefix("cpu-")}
    if platform.startswith("cpu-") and other:
        raise ValueError(f"{log} holds sessions on machines of numerics {sorted(map(str, other))}, not "
                         f"{platform}'s: a run is carried on by machines that compute alike; start it again here "
                         f"(remove the log and its checkpoints)")
    kept = {"method": method, "seed": seed, "batch": batch, "lr": lr, "platform": platform, "steps": steps,
            "steps_done": done,
            "epoch_fraction": next((r["epoch_fraction"] for r in reversed(records) if "epoch_fraction" in r), None),
            "wire_mb_per_step": wire_mb_per_step(records),
            "sessions": sessions,
            "val_loss": [[r["step"], r["val_loss"]] for r in records if "step" in r and "val_loss" in r],
            "train_loss": train}
    rows.parent.mkdir(parents=True, exist_ok=True)
    rows.write_text(json.dumps(kept, indent=1) + "\n")
    return kept


def unsettled_resumes(kept: dict) -> int:
    """How many steps after step 0 a method's run exchanged uncompressed: one per resume of a session that did not
    settle DDP's buckets first (the trainer before it did, :meth:`gpt2_bench.layout_ddp.OurHook.settle`: DDP's
    first iteration in a process is reduced as DDP does). Of several sessions resuming at one step, the last
    trained it. Plain runs exchange every step alike: 0."""
    if kept["method"] == "plain":
        return 0
    last = {session["first_step"]: session for session in kept["sessions"]}
    return sum(1 for step, session in last.items() if step > 0 and not session.get("settled"))


def wire_mb_per_step(records: Sequence[dict]) -> Optional[float]:
    """The median of a trainer log's per-step ``wire_bytes`` in MB (None: the log has none)."""
    wire = sorted(r["wire_bytes"] for r in records if "step" in r and "wire_bytes" in r)
    return round(wire[len(wire) // 2] / 1e6, 3) if wire else None


def run(method: str, seed: int, batch: str, lr: str, work: Path, rows_dir: Path = ROWS, extra: Sequence[str] = (),
        platform: Optional[str] = None) -> dict:
    """Train (or resume from its newest checkpoint) one run of the protocol in one trainer process, then write its
    curve file; returns the file's content. A run stopped early (``--max-time``, a killed session) resumes where its
    checkpoint is at the next call. ``extra``: more trainer arguments, where the run is made (``--device
    cuda-shared``, ``--dataset`` a prepared folder, ``--max-time``), not how. ``platform``: this machine's (default:
    ``"gpu"`` on CUDA, else :func:`cpu_platform`)."""
    steps, _ = schedule(batch)
    platform = platform or platform_of(extra)
    platform = cpu_platform() if platform == "cpu" else platform
    name = run_name(method, lr, platform)
    log = log_path(work, method, seed, batch, lr, platform)
    checkpoints = work / "checkpoints" / batch / f"seed-{seed}" / name
    argv = [*trainer_argv(method, seed, batch, lr, log.parent, checkpoints, platform), *extra]
    command = shlex.join(["python", "-m", "gpt2_bench.evidence", "run", method, "--seed", str(seed), "--batch", batch,
                          "--lr", lr, *(["--", *extra] if extra else [])])
    rows = curve_path(rows_dir, method, seed, batch, lr, platform)
    from gpt2_bench.checkpoint import latest, step_of
    from gpt2_bench.train import COMMAND_ENV, NUMERICS_ENV

    newest = latest(checkpoints)
    if newest is None or step_of(newest) < steps:
        subprocess.run([sys.executable, "-m", "gpt2_bench.train", *argv, "--stop-at", str(steps)], check=True,
                       env={**os.environ, COMMAND_ENV: command,
                            NUMERICS_ENV: platform.removeprefix("cpu-") if platform.startswith("cpu-") else ""})
    return keep(log, rows, method, seed, batch, lr, platform)


def finished(method: str, seed: int, batch: str, lr: str, rows_dir: Path = ROWS, platform: str = "cpu") -> bool:
    """Whether the run's curve file is kept and reaches its last step."""
    path = curve_path(rows_dir, method, seed, batch, lr, platform)
    return path.exists() and complete(json.loads(path.read_text()))


def complete(kept: dict) -> bool:
    """Whether a curve file's run reached its last step."""
    return kept["steps_done"] == kept["steps"]


def unfinished(rows_dir: Path = ROWS, platform: str = "cpu", waiting: bool = False) -> list[tuple[str, int, str, str]]:
    """The queue's runs still to make on a CPU of ``platform``, in the queue's order: a plain run not finished on
    any CPU, and a method's run that has no finished pair on one CPU platform, preceded by plain's run on
    ``platform`` where that is not finished. A method's run with uncompressed resumes (:func:`unsettled_resumes`)
    is no pair: the queue makes it again in one process, and :func:`pairs` takes the clean one. ``waiting``: the
    runs at plain's best lr of a batch whose bracket is still open are listed too, in their place, at :data:`BEST`."""
    runs = load(rows_dir)
    rates = {}
    for batch in BATCHES:  # each batch's bracket and best once; the best waits while a bracket is open
        edge = edge_lr(runs, batch)
        rates[batch] = {EDGE: edge, BEST: None if edge else best_lr(runs, batch) or "1e-3"}
    done: dict[tuple[str, int, str, str], set[str]] = {}
    for r in runs:
        if on_cpu(r) and complete(r) and not unsettled_resumes(r):
            done.setdefault((r["method"], r["seed"], r["batch"], r["lr"]), set()).add(r.get("platform", "cpu"))
    todo = []
    for method, seed, batch, lr in QUEUE:
        item = (method, seed, batch, rates[batch].get(lr, lr))
        plain = ("plain", *item[1:])
        if not item[3] and waiting and lr == BEST:
            todo.append((method, seed, batch, BEST))
        if not item[3] or done.get(item, set()) & done.get(plain, set()):
            continue
        todo += [run for run in (plain, item) if platform not in done.get(run, set())]
    return list(dict.fromkeys(todo))


def sweep_seeds(batch: str) -> set[int]:
    """The seeds the queue sweeps plain's learning rate on at ``batch``."""
    return {seed for method, seed, b, lr in QUEUE if method == "plain" and b == batch and lr in LRS}


def edge_lr(runs: list[dict], batch: str) -> Optional[str]:
    """Half plain's best learning rate at ``batch``, or twice it, while that best is the lowest or the highest rate
    every seed of the sweep (:func:`sweep_seeds`, on a CPU) has finished and beats the rate next to it; None once
    the best lies between two rates run, or before the sweep (:data:`LRS`) has finished."""
    seeds = sweep_seeds(batch)
    last: dict[str, dict[int, list[float]]] = {}  # a seed run on several CPU platforms: their mean
    for r in runs:
        if r["method"] == "plain" and r["batch"] == batch and complete(r) and on_cpu(r):
            last.setdefault(r["lr"], {}).setdefault(r["seed"], []).append(r["val_loss"][-1][1])
    swept = sorted((lr for lr, by_seed in last.items() if seeds <= set(by_seed)), key=float)
    if not seeds or not set(LRS) <= set(swept):
        return None
    mean = {lr: sum(sum(last[lr][seed]) / len(last[lr][seed]) for seed in seeds) / len(seeds) for lr in swept}
    if mean[swept[0]] < min(mean[lr] for lr in swept[1:]):
        return lr_name(float(swept[0]) / 2)
    if mean[swept[-1]] < min(mean[lr] for lr in swept[:-1]):
        return lr_name(float(swept[-1]) * 2)
    return None


def lr_name(lr: float) -> str:
    """A learning rate as the runs spell it: ``2.5e-4``, ``4e-3``."""
    mantissa, exponent = f"{lr:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def progress(rows_dir: Path = ROWS, platform: str = "cpu", work: Optional[Path] = None) -> list[str]:
    """One line per unfinished run of the queue on ``platform``, in its order: what it is, how far its curve file
    has got and, where its log under ``work`` has got further (a run in progress writes its curve file when it
    ends), how far that is. A run at plain's best lr of a batch whose bracket is still open says that it waits, in
    the place where the queue takes it up: after the bracket's runs where it comes before them in :data:`QUEUE`."""
    order = unfinished(rows_dir, platform, waiting=True)
    runs = load(rows_dir)
    for batch in dict.fromkeys(item[2] for item in order if item[3] == BEST):
        edge = edge_lr(runs, batch)
        last = max((k for k, item in enumerate(order) if item[2:] == (batch, edge)), default=-1)
        early = [item for item in order[:last] if item[2:] == (batch, BEST)]
        order = [item for item in order[:last + 1] if item not in early] + early + order[last + 1:]
    out = []
    for method, seed, batch, lr in order:
        if lr == BEST:
            out.append(f"{method} seed {seed} {batch} at plain's best lr: waits for {batch}'s bracket")
            continue
        path = curve_path(rows_dir, method, seed, batch, lr, platform)
        done = json.loads(path.read_text())["steps_done"] if path.exists() else 0
        line = f"{method} seed {seed} {batch} lr {lr}: {done} of {schedule(batch)[0]} steps kept on {platform}"
        log = None if work is None else log_path(work, method, seed, batch, lr, platform)
        if log is not None and log.exists():
            trained = 1 + max((json.loads(r).get("step", -1) for r in log.read_text().splitlines() if r.strip()),
                              default=-1)
            line += f", {trained} trained in its log" if trained > done else ""
        out.append(line)
    return out


def queue(work: Path, rows_dir: Path = ROWS, parallel: int = 1, platform: Optional[str] = None) -> None:
    """Run the queue's unfinished runs on this machine (``platform``, default :func:`cpu_platform`), ``parallel``
    at a time, each resuming from its checkpoint, reading plain's best learning rate again after each round (a
    batch's sweep decides the lr of the runs after it). One at a time by default: a run's two ranks fill two
    cores, and a checkpoint does not outlive its machine, so a run that finishes within a session beats two that
    are half done."""
    from concurrent.futures import ThreadPoolExecutor

    platform = platform or cpu_platform()
    with ThreadPoolExecutor(parallel) as pool:
        while todo := unfinished(rows_dir, platform)[:parallel]:
            for item, done in zip(todo, pool.map(
                    lambda item: run(*item, work=work, rows_dir=rows_dir, platform=platform), todo)):
                print(f"kept {item}: {done.get('steps_done')} of {done.get('steps')} steps", file=sys.stderr)
                if done.get("steps_done") != done.get("steps"):
                    raise RuntimeError(f"{item} stopped at step {done.get('steps_done')} of {done.get('steps')}: see "
                                       f"its log under {work}, then run the queue again to resume it")


# ----------------------------------------------------------------------------- the report


def t_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """``(mean, low, high)``: the 95% Student's t-interval of the mean of ``values``; one value has no interval
    (``nan`` ends)."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    mean = sum(values) / n
    if n == 1:
        return mean, math.nan, math.nan
    if n - 1 > len(T_975):
        raise ValueError(f"{n} seeds: extend T_975 past {len(T_975)} degrees of freedom")
    half = T_975[n - 2] * math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)
    return mean, mean - half, mean + half


def verdict(low: float, high: float) -> str:
    """The words for a 95% interval of the mean gap (in %): the bound it is within, a tie, or behind / ahead."""
    if math.isnan(high):
        return "one seed: no verdict"
    if low <= 0 <= high:
        bound = next((f"; within {b:g}%" for b in (0.5, 1.0) if high < b), "")
        return "tie" + bound
    if high < 0:
        return "ahead"
    return next((f"behind, within {b:g}%" for b in (0.5, 1.0) if high < b), "behind")


def load(rows_dir: Path = ROWS) -> list[dict]:
    """Every kept curve file under ``rows_dir``."""
    return [json.loads(path.read_text()) for path in sorted(rows_dir.glob("*/seed-*/*.json"))]


def best_lr(runs: list[dict], batch: str, method: str = "plain") -> Optional[str]:
    """``method``'s learning rate at ``batch`` with the lowest mean last val loss over the seeds finished at every
    lr (paired: a lucky seed run at one lr alone does not decide; over all its seeds where no seed is shared). A
    seed is a seed on a platform: a GPU's seed 0 is not the CPU's. None: none finished."""
    done = [r for r in runs if r["method"] == method and r["batch"] == batch and complete(r)]
    lrs = sorted({r["lr"] for r in done}, key=float)  # a tie goes to the lowest lr, whatever the order of files
    seeds = set.intersection(*({_seed(r) for r in done if r["lr"] == lr} for lr in lrs)) if lrs else set()
    seeds = seeds or {_seed(r) for r in done}
    means = {lr: sum(r["val_loss"][-1][1] for r in group) / len(group)
             for lr in lrs for group in [[r for r in done if r["lr"] == lr and _seed(r) in seeds]]}
    return min(means, key=means.get) if means else None


def _seed(kept: dict) -> tuple[str, int]:
    """A seed as the sweep reads it: a CPU's seed is one seed on every CPU platform, a GPU's another."""
    return "cpu" if on_cpu(kept) else kept["platform"], kept["seed"]


def pairs(runs: list[dict], method: str, batch: str, lr: str,
          plain_lr: Optional[str] = None) -> dict[int, list[tuple[str, float]]]:
    """Per evaluation step both have, every seed's gap (%) of ``method`` at ``lr`` against plain of the same seed
    and platform at ``plain_lr`` (default ``lr``); a seed is named by its number, ``g`` added on a GPU (``"2g"``).
    A seed paired on two CPU platforms counts once: by a run with no uncompressed resumes
    (:func:`unsettled_resumes`) where it has one, else by the first in name order (the runs before fingerprints)."""
    def curves(name: str, at: str) -> dict[tuple[str, int], dict]:
        return {(r.get("platform", "cpu"), r["seed"]): r for r in runs
                if r["method"] == name and r["batch"] == batch and r["lr"] == at}

    plains = curves("plain", plain_lr or lr)
    gaps: dict[int, list[tuple[str, float]]] = {}
    methods = curves(method, lr)
    for key in sorted(methods, key=lambda key: (unsettled_resumes(methods[key]) > 0, key)):
        if key not in plains:
            continue
        curve, plain = (dict(map(tuple, kept[key]["val_loss"])) for kept in (methods, plains))
        label = f"{key[1]}{'' if key[0].startswith('cpu') else 'g'}"
        for step in sorted(set(curve) & set(plain)):
            if label not in dict(gaps.get(step, [])):
                gaps.setdefault(step, []).append((label, 100 * (curve[step] / plain[step] - 1)))
    return {step: sorted(seeds, key=lambda seed: (seed[0].endswith("g"), int(seed[0].rstrip("g"))))
            for step, seeds in gaps.items()}


def decisions(runs: list[dict], batch: str) -> list[dict]:
    """Per method of the decision set, at plain's best lr at ``batch`` (1e-3 until the sweep has finished seeds):
    one row per evaluation step with the seeds' gaps, their mean and its 95% interval, and the verdict. A method
    whose own finished runs do best at another lr gets its rows there too, against plain at plain's best (their
    ``lr``: ``"own 2e-3"``)."""
    lr = best_lr(runs, batch) or "1e-3"
    out = []
    for method in METHODS:
        if method == "plain":
            continue
        own = best_lr(runs, batch, method)
        for at in [lr, *([own] if own not in (None, lr) else [])]:
            out += _rows(method, batch, lr if at == lr else f"own {at}", pairs(runs, method, batch, at, lr))
    return out


def _rows(method: str, batch: str, label: str, by_step: dict[int, list[tuple[str, float]]]) -> list[dict]:
    """One decision row per evaluation step of ``by_step`` (:func:`pairs`' gaps)."""
    out = []
    for step, gaps in sorted(by_step.items()):
        mean, low, high = t_interval([g for _, g in gaps])
        untuned = [g for seed, g in gaps if int(seed.rstrip("g")) not in TUNED_ON.get(method, ())]
        out.append({"method": method, "batch": batch, "lr": label, "step": step, "seeds": [s for s, _ in gaps],
                    "gaps": [g for _, g in gaps], "mean": mean, "low": low, "high": high,
                    "verdict": verdict(low, high), "untuned": _untuned(method, untuned)})
    return out


def _series(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """:func:`decisions`' rows by ``(method, lr)``, in their order."""
    out: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        out.setdefault((row["method"], row["lr"]), []).append(row)
    return out


def _untuned(method: str, gaps: list[float]) -> str:
    """The verdict over the seeds ``method``'s settings were not picked on (:data:`TUNED_ON`), in words."""
    if method not in TUNED_ON:
        return "(not tuned)"
    if not gaps:
        return "none yet"
    mean, low, high = t_interval(gaps)
    return f"{len(gaps)}: {_pct(mean)} [{_pct(low)}, {_pct(high)}], {verdict(low, high)}"


def tokens_per_step(batch: str) -> int:
    """Tokens per optimizer step at ``batch`` over the protocol's 2 ranks."""
    return BATCHES[batch] * 128 * 2


def batch_axis(runs: list[dict]) -> list[dict]:
    """The decision rows at each batch's last evaluation (its schedule's end, so every batch has read the same
    tokens), each with its ``tokens_per_step``: the gap against the batch."""
    return [{**row, "tokens_per_step": tokens_per_step(batch)} for batch in BATCHES
            for row in decisions(runs, batch) if row["step"] == schedule(batch)[0] - 1
            and not row["lr"].startswith("own")]


def doubling_line(points: Sequence[dict]) -> Optional[tuple[float, float]]:
    """``(gap at GPT-2's tokens per step, points per doubling)``: the least-squares line of ``points``' mean gaps
    (one method's :func:`batch_axis` rows) against log2 of their tokens per step, carried to
    :data:`GPT2_TOKENS_PER_STEP`; None under two batches. Means only: the line has no interval."""
    if len({p["tokens_per_step"] for p in points}) < 2:
        return None
    xs, ys = [math.log2(p["tokens_per_step"]) for p in points], [p["mean"] for p in points]
    x_mean, y_mean = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys)) / sum((x - x_mean) ** 2 for x in xs)
    return y_mean + slope * (math.log2(GPT2_TOKENS_PER_STEP) - x_mean), slope


def render_batch_axis(runs: list[dict]) -> list[str]:
    """Per method, what its gap against the batch implies at GPT-2's tokens per step (lines of markdown)."""
    points = batch_axis(runs)
    lines = []
    for method in METHODS:
        mine = [p for p in points if p["method"] == method]
        if not mine:
            continue
        measured = ", ".join(f"{p['tokens_per_step']:,}: {_pct(p['mean'])} [{_pct(p['low'])}, {_pct(p['high'])}] "
                             f"(seeds {','.join(p['seeds'])})" for p in mine)
        line = doubling_line(mine)
        implied = ("one batch measured: no slope yet" if line is None else
                   f"{line[1]:+.2f} points per doubling; a line through the means reads {line[0]:+.2f}% at GPT-2's "
                   f"{GPT2_TOKENS_PER_STEP:,} tokens per step (an extrapolation, without an interval)")
        lines.append(f"- {METHODS[method][0]}: mean gap at the last evaluation by tokens per step, {measured}; "
                     f"{implied}.")
    return lines or ["- no batch has a finished pair yet."]


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:+.2f}%"


def render_report(runs: list[dict]) -> str:
    """``docs/evidence.md``: the sweep, every decision at every evaluation, and what each run has done."""
    lines = ["# The loss evidence", "", "Generated by `python -m gpt2_bench.evidence rebuild` from the curve files in",
             "`docs/rows/evidence/`: do not edit by hand. The protocol is in the docstring of",
             "`gpt2_bench/evidence.py`; each run's file holds its command, commit, torch version and machine. A CPU",
             "run pairs only with plain on a machine that computes alike: its file name ends in that machine's",
             "numerics fingerprint (`-cpu-...`; none for the runs made before fingerprints, on one machine).", "",
             "To add runs: `python -m gpt2_bench.evidence queue` on a CPU (the unfinished runs in order, resumable;",
             "`queue --list` shows them and how far each is; preloading jemalloc that never returns memory,",
             "`LD_PRELOAD=libjemalloc.so.2 MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1`, spares the page faults",
             "that glibc takes on the large blocks of every step, with the same losses bit for bit),",
             "`.gpu/quality.sh` on a lent GPU (six runs at once; 16x: plain's sweep, then seeds at its best lr;",
             "all back in one `quality.tar`; its `-gpu` files pair only with each other); then copy the curve files",
             "here and run the rebuild. A verdict is the 95% t-interval of the paired mean gap:",
             "*within X%* when its upper end is below X, a *tie* when it holds 0.", "",
             "![the gap against tokens read, per batch, and against tokens per step](img/evidence-gap.png)", "",
             "## Plain's learning rate", "",
             "*Best*: the lowest mean last val loss over the seeds finished at every lr of the batch. A best at",
             "either end of the rates run is bracketed next: the queue runs the rate one doubling past it.", "",
             "| batch | lr | runs finished | their platforms | mean last val loss, all its runs |",
             "|---|---|---:|---|---:|"]
    for batch in BATCHES:
        for lr in sorted({r["lr"] for r in runs if r["method"] == "plain" and r["batch"] == batch}, key=float):
            done = [r for r in runs if r["method"] == "plain" and r["batch"] == batch and r["lr"] == lr and complete(r)]
            if done:
                mean = sum(r["val_loss"][-1][1] for r in done) / len(done)
                best = " (best)" if lr == best_lr(runs, batch) else ""
                platforms = ", ".join(sorted({r.get("platform", "cpu") for r in done}))
                lines.append(f"| {batch} | {lr}{best} | {len(done)} | {platforms} | {mean:.4f} |")
    if lines[-1].startswith("|---"):
        lines.append("| (no finished plain run yet) | | | | |")
    lines += ["", "## Decisions", "",
              "Gap: the method's val loss against plain's of the same seed, in %; the interval is the 95% t-interval "
              "of the mean over seeds. *Untuned seeds*: the same over the seeds the method's settings were not "
              "picked on (`TUNED_ON` in `gpt2_bench/evidence.py`): their count, mean [interval] and verdict.", "",
              "| batch | method | lr | step | seeds | gaps | mean | 95% interval | verdict | untuned seeds |",
              "|---|---|---|---:|---|---|---:|---|---|---|"]
    for batch in BATCHES:
        for row in decisions(runs, batch):
            lines.append(f"| {batch} | {row['method']} | {row['lr']} | {row['step'] + 1} | "
                         f"{','.join(map(str, row['seeds']))} | {', '.join(f'{g:+.2f}' for g in row['gaps'])} | "
                         f"{_pct(row['mean'])} | [{_pct(row['low'])}, {_pct(row['high'])}] | {row['verdict']} | "
                         f"{row['untuned']} |")
    if lines[-1].startswith("|---"):
        lines.append("| (no paired runs yet) | | | | | | | | | |")
    lines += ["", "## The batch axis", "",
              "Each method's gap at the end of each batch's schedule (the same tokens read), against tokens per step "
              "(the plot's last panel):",
              "", *render_batch_axis(runs)]
    lines += ["", "## One run on two machines", "",
              "The same run (method, seed, batch, lr) finished on CPUs of different numerics fingerprints: the "
              "second's val loss against the first's, in %, at each evaluation. Machines that differ in the last "
              "bits of their arithmetic can still give one plain run alike; a compressed run amplifies such a "
              "difference (its selection is discontinuous: [a protocol check](quality-diagnosis.md#a-protocol-"
              "check-a-resumes-uncompressed-step-and-how-far-one-step-moves-a-compressed-run)), so a pair is made "
              "on one machine.", "",
              *render_machines(runs)]
    lines += ["", "## The runs", "", "*MB per step*: the median of what a step sent per rank (the trainer's "
              "`wire_bytes`; a dash where the run's log was not at hand when its file was kept). *Uncompressed "
              "resumes*: steps after step 0 that a method's run exchanged uncompressed, one per resume made before "
              "the trainer settled DDP's buckets first (2026-12-03; the runs then resumed at every evaluation; "
              "`unsettled_resumes` in `gpt2_bench/evidence.py`). The queue makes such a run again in one process, "
              "and the clean run takes its seed's place in the verdicts.", "",
              "| batch | run | seed | steps done | epoch read | MB per step | uncompressed resumes | machine | torch "
              "| commit |",
              "|---|---|---:|---|---:|---:|---:|---|---|---|"]
    for r in runs:
        session = r["sessions"][-1] if r["sessions"] else {}
        machine = session.get("machine", {})
        epoch = "-" if r["epoch_fraction"] is None else f"{r['epoch_fraction']:.2f}"
        name = run_name(r["method"], r["lr"], r.get("platform", "cpu"))
        wire = "-" if r.get("wire_mb_per_step") is None else f"{r['wire_mb_per_step']:.2f}"
        lines.append(f"| {r['batch']} | {name} | {r['seed']} | {r['steps_done']} of "
                     f"{r['steps']} | {epoch} | {wire} | {unsettled_resumes(r)} | {machine.get('host', '?')} "
                     f"({machine.get('cores', '?')} cores"
                     f"{', ' + machine['gpu'] if machine.get('gpu') else ''}) | {session.get('torch', '?')} | "
                     f"{session.get('commit', '?')[:12]} |")
    return "\n".join(lines) + "\n"


def render_machines(runs: list[dict]) -> list[str]:
    """Lines of markdown: per run finished on two or more CPU platforms, each later platform's val loss against
    the first's (in name order) at every evaluation."""
    groups: dict[tuple[str, int, str, str], list[dict]] = {}
    for r in sorted(runs, key=lambda r: r.get("platform", "cpu")):
        if on_cpu(r) and complete(r):
            groups.setdefault((r["method"], r["seed"], r["batch"], r["lr"]), []).append(r)
    lines = []
    for (method, seed, batch, lr), (first, *others) in sorted(groups.items()):
        for other in others:
            mine = dict(map(tuple, other["val_loss"]))
            gaps = ", ".join(f"{step + 1}: {100 * (mine[step] / loss - 1):+.3f}%" for step, loss in first["val_loss"]
                             if step in mine)
            lines.append(f"- {method} seed {seed} {batch} lr {lr}, {other['platform']} against "
                         f"{first.get('platform', 'cpu')}: {gaps}.")
    return lines or ["- none yet."]


def render_readme(runs: list[dict]) -> str:
    """The README's quality block: per method, its last evaluation at each batch with each seed's gap and a
    verdict; then the plot."""
    lines = [README_BEGIN, "| method | batch | step | gap per seed | mean gap to plain [95% interval] | verdict | "
             "untuned seeds |", "|---|---|---:|---|---|---|---|"]
    for batch in BATCHES:
        rows = decisions(runs, batch)
        for (method, lr), mine in _series(rows).items():
            last = mine[-1]
            name = METHODS[method][0] + (f" at its own best lr, {lr[4:]}" if lr.startswith("own") else "")
            per_seed = ", ".join(f"{gap:+.2f}% ({seed})" for seed, gap in zip(last["seeds"], last["gaps"]))
            lines.append(f"| {name} | {batch} | {last['step'] + 1} | {per_seed} | "
                         f"{_pct(last['mean'])} [{_pct(last['low'])}, {_pct(last['high'])}] | {last['verdict']} | "
                         f"{last['untuned']} |")
    if len(lines) == 3:
        lines.append("| (no paired runs kept yet) | | | | | | |")
    lines += ["", "![each method's gap to plain against tokens read per batch (seeds dashed), and against tokens per "
              "step](docs/img/evidence-gap.png)", "", "Against tokens per step (the plot's last panel):", "",
              *render_batch_axis(runs)]
    return "\n".join([*lines, README_END])


def plot(runs: list[dict], path: Path) -> None:
    """Per batch, each method's mean gap against the tokens read, its 95% interval as a band (cut at the seeds'
    gaps: with two seeds it is wide) and each seed's gap dashed; last, each method's gap at each batch's end against
    tokens per step (log scale), each seed's as a cross, its :func:`doubling_line` dashed to GPT-2's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(BATCHES) + 1, figsize=(16, 4))
    for ax, batch in zip(axes, BATCHES):
        shown = [0.0]  # what the panel spans: zero, the means and every seed's gap
        for (method, lr), mine in _series(decisions(runs, batch)).items():
            shown += [g for r in mine for g in (r["mean"], *r["gaps"])]
            tokens = [(r["step"] + 1) * tokens_per_step(batch) / 1e6 for r in mine]
            label = f"{method} ({lr})" if lr.startswith("own") else method
            (line,) = ax.plot(tokens, [r["mean"] for r in mine], marker="o", label=label,
                              color=_colour(method, lr.startswith("own")))
            ax.fill_between(tokens, [r["low"] for r in mine], [r["high"] for r in mine], color=line.get_color(),
                            alpha=0.08)
            for seed in dict.fromkeys(seed for r in mine for seed in r["seeds"]):
                gaps = [(t, g) for t, r in zip(tokens, mine) for s, g in zip(r["seeds"], r["gaps"]) if s == seed]
                ax.plot(*zip(*gaps), color=line.get_color(), lw=1, ls="--", alpha=0.7)
        if not ax.lines:
            ax.text(0.5, 0.5, "no finished pair yet", ha="center", va="center", transform=ax.transAxes, color="grey")
        else:
            margin = max(0.5, 0.15 * (max(shown) - min(shown)))
            ax.set_ylim(min(shown) - margin, max(shown) + margin)
        ax.set(title=f"{batch} ({tokens_per_step(batch):,} tokens per step)", xlabel="tokens read (M)")
    axes[0].set_ylabel("val loss against plain, same seed (%)\nbands: 95% intervals, cut at the seeds' range")
    ax, points = axes[-1], batch_axis(runs)
    for method in METHODS:
        mine = [p for p in points if p["method"] == method]
        if mine:
            xs, ys = [p["tokens_per_step"] for p in mine], [p["mean"] for p in mine]
            spread = [[0 if math.isnan(p["low"]) else p["mean"] - p["low"] for p in mine],
                      [0 if math.isnan(p["high"]) else p["high"] - p["mean"] for p in mine]]
            bars = ax.errorbar(xs, ys, yerr=spread, marker="o", capsize=3, label=method, color=_colour(method))
            ax.plot([p["tokens_per_step"] for p in mine for _ in p["gaps"]], [g for p in mine for g in p["gaps"]],
                    "x", color=bars[0].get_color(), alpha=0.7)
            if (line := doubling_line(mine)) is not None:
                ax.plot([xs[-1], GPT2_TOKENS_PER_STEP], [ys[-1], line[0]], ls="--", color=bars[0].get_color())
    ax.axvline(GPT2_TOKENS_PER_STEP, color="grey", ls=":", lw=1)
    ax.text(GPT2_TOKENS_PER_STEP, ax.get_ylim()[1], "GPT-2", ha="right", va="top", fontsize=8, color="grey")
    ax.set_xscale("log", base=2)
    ax.set(title="at each batch's end", xlabel="tokens per step (dashed: extrapolated)")
    for ax in axes:
        ax.axhline(0, color="black", lw=0.8)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _colour(method: str, own_lr: bool = False) -> str:
    """The plot's colour of ``method`` (at plain's lr, or at its own), the same in every panel."""
    return f"C{(list(METHODS).index(method) + (len(METHODS) if own_lr else 0)) % 10}"


def rebuild(rows_dir: Path = ROWS) -> None:
    """Remake ``docs/evidence.md``, its plot and the README's quality block from the kept curve files."""
    runs = load(rows_dir)
    REPORT.write_text(render_report(runs))
    plot(runs, PLOT)
    text = README.read_text()
    begin, end = text.find(README_BEGIN), text.find(README_END)
    if begin < 0 or end < begin:
        raise ValueError(f"README.md has no {README_BEGIN} ... {README_END} block")
    README.write_text(text[:begin] + render_readme(runs) + text[end + len(README_END):])


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpt2_bench.evidence", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    go = sub.add_parser("run", help="train or resume one run of the protocol, keeping its curve in docs/rows/evidence")
    go.add_argument("method", choices=sorted(METHODS))
    go.add_argument("--seed", type=int, required=True)
    go.add_argument("--batch", default="1x", choices=sorted(BATCHES))
    go.add_argument("--lr", default="1e-3", help="the peak learning rate as written in the file name (default 1e-3)")
    go.add_argument("--work", default="bench_out/evidence", help="logs and checkpoints (default bench_out/evidence)")
    go.add_argument("--rows", default=str(ROWS), help=f"where the curve files go (default {ROWS.relative_to(ROOT)})")
    go.add_argument("--in-one", action="store_true",
                    help="(what every run does now; kept so that the commands earlier curve files record still run)")
    go.epilog = ("after --: trainer arguments for where it runs, e.g. -- --device cuda-shared --dataset "
                 ".gpu/data/mix --max-time 420")
    line = sub.add_parser("queue", help="run the queue's unfinished runs in order, a few at a time, resuming each")
    line.add_argument("--parallel", type=int, default=1, help="runs at once (default 1: two ranks per two cores)")
    line.add_argument("--work", default="bench_out/evidence", help="logs and checkpoints (default bench_out/evidence)")
    line.add_argument("--rows", default=str(ROWS), help=f"where the curve files go (default {ROWS.relative_to(ROOT)})")
    line.add_argument("--list", action="store_true",
                      help="print the unfinished runs in order and how far each is, and stop")
    sub.add_parser("rebuild", help="remake docs/evidence.md, its plot and the README's quality block")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.extra = argv[cut + 1:]
    if args.extra and args.command != "run":
        parser.error("trainer arguments after -- go with the run command only")
    if args.command == "run":
        try:
            float(args.lr)
        except ValueError:
            parser.error(f"--lr takes a number such as 1e-3, got {args.lr!r}")
        run(args.method, args.seed, args.batch, args.lr, Path(args.work), Path(args.rows), args.extra)
    elif args.command == "queue" and args.list:
        print("\n".join(progress(Path(args.rows), cpu_platform(), Path(args.work))) or "the queue is done")
    elif args.command == "queue":
        queue(Path(args.work), Path(args.rows), args.parallel)
    else:
        rebuild()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
