"""The loss evidence: the decision runs, their curves kept in ``docs/rows/evidence``, and the one command that
rebuilds every quality number of the README and ``docs/evidence.md`` from those files.

The protocol (``PROTOCOL``): GPT-2 ``small`` under DDP on 2 ranks (:data:`RANKS`: the runs on more), the ``mix`` corpus
read without replacement (:meth:`gpt2_bench.data.TokenData.train_batch`), one eval set of 131,072 val tokens shared by
every seed, method and batch (evaluated every 200 steps at 1x), and the same token budget at every batch: 2,000 steps of
1,024 tokens, 500 of 4,096, 125 of 16,384. A decision pairs a method with plain DDP of the same seed, batch and learning
rate, run where the arithmetic comes out the same (:func:`cpu_platform`: a CPU's runs are named by the machine's
numerics fingerprint and pair only within it, so a pair may span sessions on machines that share it; a GPU's, in bf16
autocast, keep ``-gpu`` files and pair only with each other, their seeds marked ``g``): each seed gives one gap (the
method's val loss over plain's, minus 1), and the verdict is the 95% t-interval of the mean gap over seeds. "Within X%"
means the interval's upper end is below X; an interval that holds 0 is a tie. Plain's learning rate is the one of the
sweep (``plain`` at several ``--lr``) with the lowest mean final loss, bracketed (a best at an end of the sweep adds the
rate one doubling past it, :data:`EDGE`), and every method is judged at it. A method whose settings earlier screens
picked on some seeds (:data:`TUNED_ON`) gets a second verdict over its other seeds alone. A method exchanges every step
after step 0 compressed, a resumed one too (the trainer settles DDP's buckets first); the runs resumed before it did
count their uncompressed steps (:func:`unsettled_resumes`, in the report), and the queue makes them again.

``python -m gpt2_bench.evidence run METHOD --seed S [--batch 4x] [--lr 2e-3]`` trains one run in one process,
checkpointing at every evaluation, so that a stopped run resumes where it was (``--resume`` from its checkpoint), and
writes its curve file, to be committed at once; ``python -m gpt2_bench.evidence rebuild`` remakes ``docs/evidence.md``,
its plot and the README's quality block (:mod:`gpt2_bench.evidence.report`; the command line: ``__main__.py``);
``tests/test_evidence.py`` checks that they match the kept files.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
ROWS = ROOT / "docs" / "rows" / "evidence"

PROTOCOL = ["--preset", "small", "--integration", "ddp", "--dataset", "mix", "--block-size", "128",
            "--eval-tokens", "131072", "--threads", "1"]
WORLD = 2
"""The protocol's ranks; each rank reads its share of a step's windows (:data:`RANKS`: the methods run on more)."""
TOKENS = 2000 * 4 * 128 * WORLD
"""The token budget of every run, whatever its batch."""
BATCHES = {"1x": 4, "4x": 16, "16x": 64}
"""Per-rank batch (windows of 128 tokens) at 1x, 4x and 16x the tokens per step."""
EVALUATIONS = 10
"""Evaluations per run, evenly spaced (every 200 steps at 1x)."""
LRS = ("5e-4", "1e-3", "2e-3")
"""Plain's learning-rate sweep."""
TAGC_FLAGS = ["--compression", "non-attn", "--codec", "tagc"]
TOPK_FLAGS = ["--compression", "non-attn", "--codec", "topk"]
"""The trainer's flags for ``tagc.hook()`` and ``tagc.hook(codec="topk")``; a variant adds its own."""
METHODS: dict[str, tuple[str, list[str]]] = {
    "plain": ("plain DDP", ["--compression", "none", "--transport", "gloo"]),
    "tagc": ("`tagc.hook()` + `hook.follow_lr(optimizer)`", [*TAGC_FLAGS, "--feedback-decay-follows-lr"]),
    "tagc-brief": ("`tagc.hook(ratio=10, index_bits=1)`", [*TAGC_FLAGS, "--ratio", "10", "--index-bits", "1"]),
    "int4": ("`tagc.hook(codec=\"int4\", select=\"all\")`", ["--compression", "all", "--codec", "int4"]),
    "topk": ("`tagc.hook(codec=\"topk\")`", TOPK_FLAGS),
    "powersgd-r16": ("PowerSGD rank 16 (`tagc.hook(codec=\"powersgd\", select=\"all\", rank=16)`)",
                     ["--compression", "all", "--codec", "powersgd", "--codec-option", "rank=16"]),
    "tagc-ratio2.25": ("`tagc.hook(ratio=2.25)` + `hook.follow_lr(optimizer)`",
                       [*TAGC_FLAGS, "--feedback-decay-follows-lr", "--ratio", "2.25"]),
    "tagc-no-follow": ("`tagc.hook()` without `hook.follow_lr`", TAGC_FLAGS),
    "topk-dense": ("`tagc.hook(codec=\"topk\", sparsity=0.3)`", [*TOPK_FLAGS, "--sparsity", "0.3"]),
    "topk-4ranks": ("`tagc.hook(codec=\"topk\")` on four ranks", TOPK_FLAGS),
    "topk-4ranks-share": ("`tagc.hook(codec=\"topk\", sparsity=0.645)` on four ranks",
                          [*TOPK_FLAGS, "--sparsity", "0.645"]),
}
"""The decision set, then a candidate fix for the gap that grows with the batch (at 4x on a CPU; at 16x on a GPU, last),
then an ablation: run name -> (what users call, the trainer's flags). ``tagc-ratio2.25`` sends twice ``tagc.hook()``'s
bytes per exchange, still half its bytes per token read at 4x the tokens per step: the fix the thirteenth screen of
``docs/quality-diagnosis.md`` points to. ``tagc-no-follow`` is ``tagc.hook()`` with its fixed fading, the run that says
whether ``hook.follow_lr(optimizer)``, which the README shows with it, earns its line. ``topk-dense``, 70% of each
rank's entries sent where ``topk`` sends 35%, is that fix for the list."""
RANKS: dict[str, int] = {"topk-4ranks": 4, "topk-4ranks-share": 4}
"""A method run on more ranks than :data:`WORLD`, at plain's global batch, so that it pairs with plain: the sparse
codecs' share per rank falls with the group; ``topk-4ranks-share`` keeps the two-rank share (the known issue's fix)."""
ABLATIONS = {"tagc": "tagc-no-follow", "topk-dense": "topk", "topk-4ranks": "topk", "topk-4ranks-share": "topk-4ranks"}
"""A method -> the same method with one setting left out (or two ranks for four): the method's paired gap over it, seed
by seed, is what that setting buys (negative: the setting lowers the loss)."""
TUNED_ON: dict[str, tuple[int, ...]] = {"powersgd-r16": (0,), **dict.fromkeys(
    ("tagc", "tagc-brief", "topk", "tagc-ratio2.25", "tagc-no-follow", "topk-dense", "topk-4ranks",
     "topk-4ranks-share"), (0, 1))}
"""The seeds whose model initialisation (``torch.manual_seed(seed)``, here as then) the earlier protocol's screens
picked a method's settings on: ratio 4.5, fading 0.9 and ``follow_lr``; ``tagc-brief``'s fading and wire (the brief
fixes its ratio and index, and ``tagc.hook()``'s defaults give the rest); ``topk``'s ratio 1.2 and float8 values;
PowerSGD's rank 16; ``tagc-ratio2.25``'s ratio and ``topk-dense``'s density on plain seed 1's weights, the rest as
``tagc`` and ``topk`` (their windows were drawn with replacement, so they differ from these). A method listed here gets
a second verdict over its other seeds alone."""
BEST = "best"
"""A queue item's learning rate meaning plain's best at its batch (:func:`best_lr`). Until the sweep has finished
(:func:`sweep_means`), and while its best is at one of its ends (:data:`EDGE`), the items at ``BEST`` of that batch
wait."""
EDGE = "edge"
"""A queue item's learning rate meaning the rate one doubling past plain's best at its batch while that best is the
lowest or the highest rate swept (:func:`edge_lr`): a best at an end of the sweep is not yet bracketed. The item drops
out of the queue once the best is bracketed."""
QUEUE: tuple[tuple[str, int, str, str], ...] = (
    *(("plain", seed, "1x", lr) for seed in (0, 1) for lr in ("1e-3", "5e-4", "2e-3")),
    *(("plain", 0, "4x", lr) for lr in (*LRS, EDGE)),
    *((m, seed, "4x", BEST) for seed in (0, 1) for m in ("plain", "tagc", "topk")),
    *(("tagc-ratio2.25", seed, "4x", BEST) for seed in (0, 1)),
    *((m, seed, "4x", BEST) for seed in (2, 3) for m in ("plain", "topk")),
    *(("int4", seed, "4x", BEST) for seed in (2, 3)),
    *(("plain", seed, "1x", EDGE) for seed in (0, 1)),
    *(("tagc-brief", seed, "4x", BEST) for seed in (2, 3)),
    *((m, seed, "1x", BEST) for seed in (2, 3, 4, 5) for m in ("plain", "topk", "tagc")),
    *(("tagc-brief", seed, "1x", BEST) for seed in (2, 3, 4, 5)),
    *(("powersgd-r16", seed, "1x", BEST) for seed in (2, 3)),
    *(("int4", seed, "1x", BEST) for seed in (2, 3)),
    *(("tagc", seed, "4x", BEST) for seed in (2, 3)),
    *(("tagc-no-follow", seed, "1x", BEST) for seed in (2, 3)),
    *(("plain", 0, "16x", lr) for lr in (*LRS, EDGE)),
    *(("tagc-no-follow", seed, "1x", BEST) for seed in (4, 5)),
    *((m, 1, "16x", BEST) for m in ("plain", "tagc")),
    *(("topk", seed, "16x", BEST) for seed in (0, 1, 2)),
    *((m, seed, "16x", BEST) for seed in (2, 3) for m in ("plain", "tagc")),
    ("int4", 0, "16x", BEST),
    *(("topk-dense", seed, "16x", BEST) for seed in (2, 3)),
    ("int4", 1, "16x", BEST),
    ("topk", 3, "16x", BEST),
    *((m, seed, "4x", BEST) for m in ("topk-4ranks", "topk-4ranks-share") for seed in (2, 3)),
    *(("int4", seed, "4x", BEST) for seed in (0, 1)),
    *(("tagc-brief", seed, "16x", BEST) for seed in (0, 1)),
    *(("topk-dense", seed, "4x", BEST) for seed in (2, 3)),
    *((m, seed, "1x", BEST) for seed in (0, 1) for m in ("tagc", "topk", "tagc-brief")),
)
"""The CPU's order of work (``queue``): at each batch, plain's learning-rate sweep, bracketed where its best is at an
end (:data:`EDGE`), before the methods judged at its best (:data:`BEST`); of those, the pairs that decide most first:
``tagc`` and ``topk`` (the README's pick over it), the candidate fixes for the gap that grows with the batch
(``tagc-ratio2.25``, ``topk-dense``: the twelfth and thirteenth screens of ``docs/quality-diagnosis.md``) and the seeds
no setting was picked on (:data:`TUNED_ON`), then the rest of the decision set and the ablations. 4x before 1x's untuned
seeds (its pairs were the tighter), 16x after (a lent GPU runs its whole set in one call, ``.gpu/quality.sh``), then the
list on four ranks at 4x, at its planned share and at two ranks' (the fourteenth screen's question, in the loss; at 16x
they outgrow this CPU), and ``int4``'s seeds 0 and 1 at 4x (two seeds leave the README's FSDP pick a wide interval)
before the brief's line at 16x. Last, 1x seeds 0 and 1 of the tuned methods: they add to the verdict over every seed."""


def tokens_per_step(batch: str) -> int:
    """Tokens per optimizer step at ``batch`` over the protocol's :data:`WORLD` ranks."""
    return BATCHES[batch] * 128 * WORLD


def schedule(batch: str) -> tuple[int, int]:
    """``(steps, eval interval)`` of ``batch`` at the fixed token budget."""
    if batch not in BATCHES:
        raise ValueError(f"batch must be one of {sorted(BATCHES)}, got {batch!r}")
    steps = TOKENS // tokens_per_step(batch)
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
    world = RANKS.get(method, WORLD)
    return [*PROTOCOL, *METHODS[method][1], "--world", str(world), "--batch-size", str(BATCHES[batch] * WORLD // world),
            "--steps", str(steps), "--eval-interval", str(interval), "--lr", lr, "--seed", str(seed), "--name",
            run_name(method, lr, platform), "--out-dir", str(out_dir), "--checkpoint-dir", str(checkpoint_dir),
            "--checkpoint-every", str(interval), "--keep-checkpoints", "1", "--resume"]


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
            "wire_mb_per_step": wire_mb_per_step(records), "sessions": sessions,
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
    """The queue's runs still to make on a CPU of ``platform``, in the queue's order: a plain run not finished on any
    CPU, and a method's run that has no finished pair on one CPU platform, preceded by plain's run on ``platform`` where
    that is not finished. A method's run with uncompressed resumes (:func:`unsettled_resumes`) is no pair: the queue
    makes it again in one process, and :func:`pairs` takes the clean one. ``waiting``: the runs at plain's best lr of a
    batch whose sweep or bracket is still open are listed too, in their place, at :data:`BEST`."""
    runs = load(rows_dir)
    rates = {}
    for batch in BATCHES:  # each batch's bracket and best once; the best waits while the sweep or a bracket is open
        mean = sweep_means(runs, batch)
        edge = edge_lr(mean)
        rates[batch] = {EDGE: edge, BEST: None if edge or mean is None else best_lr(runs, batch)}
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


def sweep_means(runs: list[dict], batch: str) -> Optional[dict[str, float]]:
    """Plain's mean last val loss at ``batch`` per rate that every seed of the sweep (:func:`sweep_seeds`) has
    finished on a CPU (a seed run on several CPU platforms: their mean), or None before every rate of the sweep
    (:data:`LRS`) has."""
    seeds = sweep_seeds(batch)
    last: dict[str, dict[int, list[float]]] = {}
    for r in runs:
        if r["method"] == "plain" and r["batch"] == batch and complete(r) and on_cpu(r):
            last.setdefault(r["lr"], {}).setdefault(r["seed"], []).append(r["val_loss"][-1][1])
    swept = [lr for lr, by_seed in last.items() if seeds <= set(by_seed)]
    if not seeds or not set(LRS) <= set(swept):
        return None
    return {lr: sum(sum(last[lr][seed]) / len(last[lr][seed]) for seed in seeds) / len(seeds)
            for lr in sorted(swept, key=float)}


def edge_lr(mean: Optional[dict[str, float]]) -> Optional[str]:
    """Half plain's best learning rate, or twice it, while that best is the lowest or the highest rate of a
    batch's sweep (``mean``: :func:`sweep_means`'s) and beats the rate next to it; None once the best lies between
    two rates run, or before the sweep has finished (``mean`` None)."""
    if mean is None:
        return None
    swept = list(mean)
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
    """One line per unfinished run of the queue on ``platform``, in its order: what it is, how far its curve file has
    got and, where its log under ``work`` has got further (a run in progress writes its curve file when it ends), how
    far that is. A run at plain's best lr of a batch whose sweep or bracket is still open says that it waits, in the
    place where the queue takes it up: after the bracket's runs where it comes before them in :data:`QUEUE`."""
    order = unfinished(rows_dir, platform, waiting=True)
    runs = load(rows_dir)
    waits_for = {}
    for batch in dict.fromkeys(item[2] for item in order if item[3] == BEST):
        edge = edge_lr(sweep_means(runs, batch))
        waits_for[batch] = "bracket" if edge else "sweep"
        if edge is None:  # its sweep's runs come first in the queue
            continue
        last = max((k for k, item in enumerate(order) if item[2:] == (batch, edge)), default=-1)
        early = [item for item in order[:last] if item[2:] == (batch, BEST)]
        order = [item for item in order[:last + 1] if item not in early] + early + order[last + 1:]
    out = []
    for method, seed, batch, lr in order:
        if lr == BEST:
            out.append(f"{method} seed {seed} {batch} at plain's best lr: waits for {batch}'s {waits_for[batch]}")
            continue
        path = curve_path(rows_dir, method, seed, batch, lr, platform)
        done = json.loads(path.read_text())["steps_done"] if path.exists() else 0
        line = f"{method} seed {seed} {batch} lr {lr}: {done} of {schedule(batch)[0]} steps kept on {platform}"
        log = None if work is None else log_path(work, method, seed, batch, lr, platform)
        if log is not None and log.exists():
            records = [json.loads(r) for r in log.read_text().splitlines() if r.strip()]
            trained = 1 + max((r.get("step", -1) for r in records), default=-1)
            line += f", {trained} trained in its log" if trained > done else ""
            plain = curve_path(rows_dir, "plain", seed, batch, lr, platform)
            line += interim_gap(records, plain) if method != "plain" else ""
        out.append(line)
    return out


def gap_percent(loss: float, plain_loss: float) -> float:
    """A method's val loss against plain's at the same step, in percent (positive: behind plain)."""
    return 100 * (loss / plain_loss - 1)


def interim_gap(records: Sequence[dict], plain: Path) -> str:
    """``", +1.57% to plain at step 1200"``: a trainer log's val loss at its newest evaluation that plain's kept
    curve (``plain``) also has, against plain's, so that a run in progress can be read before it is kept; ``""``
    where none is shared."""
    theirs = dict(map(tuple, json.loads(plain.read_text())["val_loss"])) if plain.exists() else {}
    ours = {r["step"]: r["val_loss"] for r in records if "val_loss" in r and r.get("step") in theirs}
    if not ours:
        return ""
    step = max(ours)
    return f", {gap_percent(ours[step], theirs[step]):+.2f}% to plain at step {step + 1}"


def queue(work: Path, rows_dir: Path = ROWS, platform: Optional[str] = None) -> None:
    """Run the queue's unfinished runs on this machine (``platform``, default :func:`cpu_platform`) one at a time,
    each resuming from its checkpoint, reading plain's best learning rate again after each (a batch's sweep decides
    the lr of the runs after it). One at a time: a run's two ranks fill two cores, and a checkpoint does not outlive
    its machine, so a run that finishes within a session beats two that are half done."""
    platform = platform or cpu_platform()
    while todo := unfinished(rows_dir, platform):
        done = run(*todo[0], work=work, rows_dir=rows_dir, platform=platform)
        print(f"kept {todo[0]}: {done.get('steps_done')} of {done.get('steps')} steps", file=sys.stderr)
        if done.get("steps_done") != done.get("steps"):
            raise RuntimeError(f"{todo[0]} stopped at step {done.get('steps_done')} of {done.get('steps')}: see its "
                               f"log under {work}, then run the queue again to resume it")


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
