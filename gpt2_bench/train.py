"""Train GPT-2 with sharded data parallelism: one rank's loop, and the command line.

``python -m gpt2_bench.train --integration fsdp2 --compression non-attn --link 10gbit``
launches ``--world`` gloo ranks under torchrun (inside a shaped network namespace when
``--link`` is given; on ``--hosts`` emulated hosts, :mod:`gpt2_bench.launch`), trains with
AdamW (warmup + cosine), evaluates periodically, and writes a JSON line per step plus a
summary.

The settings are :class:`gpt2_bench.config.TrainConfig`; the FSDP wrapping
:mod:`gpt2_bench.sharding`; the loop is :func:`worker`.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional, Sequence

from gpt2_bench.config import DEVICES, TrainConfig, build_parser, config_from_args
from gpt2_bench.host_bytes import HostCounter
from gpt2_bench.sharding import compiled, shard
from testbed.rank_exit import exit_without_teardown


def resolve_device(choice: str) -> tuple[str, str]:
    """``--device`` -> ``(device type, process-group backend)``: ``("cuda", "cpu:gloo,cuda:nccl")`` (NCCL for CUDA
    tensors, gloo for CPU ones such as ``all_gather_object``'s), ``("cuda", "gloo")`` for ``cuda-shared`` (every rank on
    one GPU: NCCL refuses two ranks on one device, gloo stages CUDA tensors through the host) or ``("cpu", "gloo")``.
    Raises ``RuntimeError`` for ``cuda`` without a visible CUDA device (before any process group)."""
    import torch

    if choice not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {choice!r}")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cpu":
        return "cpu", "gloo"
    if not torch.cuda.is_available():
        built = f"this torch ({torch.__version__}) is built without CUDA" if torch.version.cuda is None else (
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU (driver, CUDA_VISIBLE_DEVICES?)")
        raise RuntimeError(f"--device {choice}: no CUDA device is available: {built}. Use --device cpu (or auto).")
    if choice == "cuda-shared":
        return "cuda", "gloo"
    if not torch.distributed.is_nccl_available():
        raise RuntimeError("--device cuda: this torch has no NCCL; the GPU ranks need it")
    return "cuda", "cpu:gloo,cuda:nccl"


def gpu_index(device_choice: str, rank: int) -> int:
    """The GPU this rank computes on: GPU 0 for every rank under ``cuda-shared``, else its index on its node
    (``LOCAL_RANK`` under torchrun, several nodes too; else the rank, every rank being on this machine)."""
    return 0 if device_choice == "cuda-shared" else int(os.environ.get("LOCAL_RANK", rank))


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warmup, then cosine decay to ``min_lr`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (cfg.lr - cfg.min_lr)


# ----------------------------------------------------------------------------- one rank


def _evaluate(model, data, cfg: TrainConfig, rank: int, world: int, block_size: int, device=None) -> float:
    """Mean loss over the fixed eval set (:meth:`gpt2_bench.data.TokenData.eval_batches`), the same windows for every
    seed, method and batch size."""
    import torch
    import torch.distributed as dist

    device = torch.device("cpu") if device is None else device
    model.eval()
    total = torch.zeros(2, device=device)  # summed window losses, windows
    with torch.no_grad(), _autocast(device):
        for x, y in data.eval_batches(cfg.eval_tokens, block_size, EVAL_BATCH, device, rank, world):
            total[0] += model(x, y)[1].detach().float() * len(x)
            total[1] += len(x)
    model.train()
    dist.all_reduce(total)
    return float(total[0] / total[1])


EVAL_BATCH = 32
"""Windows per forward pass of the evaluation (memory, not the result: the loss is a mean over windows)."""


def run_record(cfg: TrainConfig, first_step: int, device) -> dict:
    """The log's record of where and how a session of the run ran: the command, the settings, the commit, torch and
    the machine. A resumed run appends one per session, so a curve carried across machines says so."""
    import platform
    import subprocess

    import torch

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                                  cwd=Path(__file__).resolve().parent).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    machine_id = Path("/etc/machine-id").read_text().strip() if Path("/etc/machine-id").exists() else ""
    dirty = "-dirty" if git("status", "--porcelain", "--untracked-files=no") else ""
    return {"run": cfg.run_name, "first_step": first_step, "command": os.environ.get(COMMAND_ENV, ""),
            "config": json.loads(cfg.to_json()), "commit": git("rev-parse", "HEAD") + dirty, "torch": torch.__version__,
            "machine": {"host": platform.node(), "id": machine_id[:12], "cpu": cpu, "cores": os.cpu_count(),
                        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                        "numerics": os.environ.get(NUMERICS_ENV) or None}}


COMMAND_ENV = "TAGC_TRAIN_COMMAND"
"""Set by the command line to the command as given, so that each rank's log can record it."""
NUMERICS_ENV = "TAGC_NUMERICS"
"""Where a launcher that names the machine's numerics (:func:`gpt2_bench.evidence.cpu_platform`) tells the run, for
its session record."""


HEAP_KEEP_BYTES = 256 << 20


def keep_freed_memory() -> bool:
    """Have glibc keep freed memory below :data:`HEAP_KEEP_BYTES` for reuse (heap, never trimmed) instead of
    ``munmap``ing it: on the CPU every step frees and allocates its activations again, and their page faults
    slow it (docs/results.md, "The main job"). False if not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, HEAP_KEEP_BYTES)) and bool(mallopt(m_trim_threshold, 4 * HEAP_KEEP_BYTES))


def _autocast(device):
    """bf16 autocast on CUDA; nothing on the CPU (the CPU runs stay in fp32, as before)."""
    import contextlib

    import torch

    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def _dropped_backward(step_fn, opt, device, x, y) -> None:
    """A forward and backward on ``x, y`` whose gradients are dropped, the RNG left as it was (DDP's first
    iteration of a resumed process: :meth:`gpt2_bench.layout_ddp.OurHook.settle`)."""
    import torch

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        with _autocast(device):
            _, loss = step_fn(x, y)
        loss.backward()
    opt.zero_grad(set_to_none=True)


def _sync(device) -> None:
    """Wait for the GPU before reading the clock (step times); nothing on the CPU."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker(cfg: TrainConfig, rank: int, world: int, data_dir: str, log_path: str) -> None:
    """Train on one rank (process group already initialised); rank 0 writes the log."""
    import torch
    import torch.distributed as dist

    from gpt2_bench.data import TokenData
    from gpt2_bench.model import GPT, GPTConfig

    torch.set_num_threads(cfg.threads)
    keep_freed_memory()
    device_type, _ = resolve_device(cfg.device)
    device = torch.device(device_type, gpu_index(cfg.device, rank)) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(cfg.seed)
    model_cfg = GPTConfig.preset(cfg.preset, **({"block_size": cfg.block_size} if cfg.block_size else {}))
    model = GPT(model_cfg).to(device)
    n_params = model.num_params()
    grad_mb = n_params * 4 / 2**20  # the unsharded fp32 gradient, counted before sharding
    model, hook = shard(model, cfg, world, device)
    step_fn = compiled(model, cfg) if cfg.compile else model
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr)
    if cfg.feedback_decay_follows_lr:
        hook.follow_lr(opt)  # as users call it
    data = TokenData(data_dir)
    first_step = _restore(cfg, model, opt, hook)
    settled = first_step > 0 and cfg.integration == "ddp" and hook.settle(
        lambda: _dropped_backward(step_fn, opt, device, *data.train_batch(
            first_step, cfg.batch_size, model_cfg.block_size, cfg.seed, device, rank, world)))
    log = _open_log(log_path, first_step) if rank == 0 else None
    if log is not None:
        log.write(json.dumps({**run_record(cfg, first_step, device), **({"settled": True} if settled else {})}) + "\n")
    diagnostics = None
    if cfg.diagnostics:
        from gpt2_bench.diagnostics import StepDiagnostics

        codec = cfg.codec if cfg.compression != "none" else "none"
        header = {"run": cfg.run_name, "codec": codec, "seed": cfg.seed} if first_step == 0 else None
        diagnostics = StepDiagnostics(model, opt, hook, _open_diagnostics(log_path, first_step) if rank == 0 else None,
                                      cfg.compression, cfg.grad_clip, header=header,
                                      replicated=cfg.integration == "ddp")
    host_counter = HostCounter.for_rank(log_path)
    progress = None
    if rank == 0:
        from tqdm.auto import tqdm

        progress = tqdm(total=cfg.steps, initial=first_step, desc=cfg.run_name, unit="step", file=sys.stderr,
                        leave=False)
    start = time.perf_counter()
    val_loss = float("nan")
    stopped_at = None
    for step in range(first_step, cfg.steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(cfg, step)
        _sync(device)
        if host_counter is not None:
            host_counter.start()
        tick = time.perf_counter()
        x, y = data.train_batch(step, cfg.batch_size, model_cfg.block_size, cfg.seed, device, rank, world)
        with _autocast(device):
            _, loss = step_fn(x, y)
        if step == cfg.fault_step and rank == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        _sync(device)
        forward_s = time.perf_counter() - tick
        loss.backward()
        _sync(device)
        backward_s = time.perf_counter() - tick - forward_s
        grad_norm = None
        if diagnostics is not None:
            diagnostics.after_backward()
        if cfg.grad_clip or diagnostics is not None:  # without clipping, max_norm inf scales by 1.0: a no-op
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
        if diagnostics is not None:
            diagnostics.before_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        iter_s = time.perf_counter() - tick
        if host_counter is not None:
            host_counter.stop(step)
        record = {"step": step, "loss": float(loss.detach()), "lr": learning_rate(cfg, step), "iter_ms": iter_s * 1e3,
                  "forward_ms": forward_s * 1e3, "backward_ms": backward_s * 1e3,
                  "elapsed_s": time.perf_counter() - start,
                  "tokens": (step + 1) * cfg.batch_size * model_cfg.block_size * world}
        if hook is not None:
            hook.end_step()
            stats = hook.stats()
        if diagnostics is not None:
            diagnostics.after_step(step, learning_rate(cfg, step), grad_norm,
                                   dense=hook is None or cfg.compression == "none" or step < hook.dense_steps)
        if hook is not None:
            last = stats["last_step"]
            exchange_s = last["compress_s"] + last["exposed_s"] + last["decode_s"]  # the step's time on the exchange
            record.update(
                exchange_ms=exchange_s * 1e3, exchange_ms_per_mb=exchange_s * 1e3 / grad_mb,
                compress_ms=last["compress_s"] * 1e3, exposed_ms=last["exposed_s"] * 1e3, wire_ms=last["wire_s"] * 1e3,
                decode_ms=last["decode_s"] * 1e3, wire_bytes=last["wire_bytes"],
                plain_bytes=last["plain_equivalent_bytes"],
                inter_host_bytes=last.get("inter_host_bytes", 0) * world,  # every rank alike: all hosts' exchange
                peel_success=last["peel_success"], unpeeled=last["unpeeled"],
                units={u["unit"]: {"wire_ms": u["wire_s"] * 1e3, "exposed_ms": u["exposed_s"] * 1e3,
                                   "bytes": u["wire_bytes"]} for u in stats["units"]})
        if (step + 1) % cfg.eval_interval == 0 or step + 1 == cfg.steps:
            val_loss = _evaluate(model, data, cfg, rank, world, model_cfg.block_size, device)
            record["val_loss"] = val_loss
        if log is not None:
            log.write(json.dumps(record) + "\n")
            log.flush()
            progress.update(1)
            progress.set_postfix(loss=f"{record['loss']:.3f}", ms=f"{record['iter_ms']:.0f}")
        out_of_time = cfg.max_time_s is not None and _any_rank(time.perf_counter() - start > cfg.max_time_s, device)
        stop_here = out_of_time or (cfg.stop_at is not None and step + 1 == cfg.stop_at < cfg.steps)
        if cfg.checkpoint_every and ((step + 1) % cfg.checkpoint_every == 0 or stop_here):
            from gpt2_bench import checkpoint

            checkpoint.save(cfg.checkpoint_dir, step + 1, model, opt, hook, keep=cfg.keep_checkpoints)
        if stop_here:
            stopped_at = step + 1
            break
    if host_counter is not None:
        host_counter.close()
    if diagnostics is not None:
        diagnostics.close()
    if rank == 0:
        progress.close()
        total = hook.stats()["total"] if hook is not None else None
        gpu = {} if device.type != "cuda" else {"peak_gpu_mb": torch.cuda.max_memory_allocated(device) / 2**20,
                                                "peak_gpu_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20}
        log.write(json.dumps({
            "summary": True, "n_params": n_params, "grad_mb": grad_mb, "val_loss": val_loss, "hook_total": total,
            "first_step": first_step, "stopped_at": stopped_at,
            "epoch_fraction": data.epoch_fraction((stopped_at or cfg.steps) * cfg.batch_size * world,
                                                  model_cfg.block_size),
            "device": str(device), **gpu}) + "\n")
        log.close()
    dist.barrier()


def _restore(cfg: TrainConfig, model, opt, hook) -> int:
    """With ``resume``, load the newest complete checkpoint; returns the first step to train."""
    if not cfg.resume:
        return 0
    from gpt2_bench import checkpoint

    path = checkpoint.latest(cfg.checkpoint_dir)
    if path is None:
        print(f"no complete checkpoint in {cfg.checkpoint_dir}: training from step 0", file=sys.stderr)
        return 0
    first_step = checkpoint.load(path, model, opt, hook)
    print(f"resumed from {path} (step {first_step})", file=sys.stderr)
    return first_step


def _trim(path: Path, keep) -> None:
    """Keep the records of ``path`` that ``keep`` accepts: a resumed run's, of the steps it does not redo."""
    if path.exists():
        path.write_text("".join(line + "\n" for line in path.read_text().splitlines()
                                if line.strip() and keep(json.loads(line))))


def _open_log(log_path: str, first_step: int):
    """The step log, for appending (a resumed run keeps its sessions' records; an earlier summary goes)."""
    if first_step == 0:
        return open(log_path, "w")
    _trim(Path(log_path), lambda record: "run" in record or record.get("step", math.inf) < first_step)
    return open(log_path, "a")


def _open_diagnostics(log_path: str, first_step: int) -> str:
    """``<run>.diagnostics.jsonl`` beside the run's log, trimmed on resume (the header kept)."""
    path = Path(log_path).with_name(Path(log_path).name.removesuffix(".jsonl") + ".diagnostics.jsonl")
    if first_step:
        _trim(path, lambda record: record.get("step", -1) < first_step)
    return str(path)


def _any_rank(flag: bool, device=None) -> bool:
    """Whether ``flag`` is true on some rank (a collective: every rank decides alike). The flag
    travels on ``device`` (the ranks' device: NCCL takes no CPU tensor)."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value)


def _worker_main(args) -> None:
    """One rank under torchrun (``env://``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``)."""
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable()  # a rank killed by a signal (SIGSEGV, SIGABRT) prints its Python stack

    cfg = TrainConfig(**json.loads(Path(args.config).read_text()))
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    try:
        device_type, backend = resolve_device(cfg.device)
    except RuntimeError as err:
        raise SystemExit(f"gpt2_bench.train (rank {rank}): {err}") from None
    if device_type == "cuda":
        import torch

        torch.cuda.set_device(gpu_index(cfg.device, rank))  # before the group: NCCL binds each rank to its GPU
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=cfg.group_timeout_s))
    try:
        worker(cfg, rank, world, args.data_dir, args.log)
    finally:
        dist.destroy_process_group()
    exit_without_teardown()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        _worker_main(args)
        return 0
    cfg = config_from_args(args)
    try:
        resolve_device(cfg.device)  # a clear error here, not in every rank's traceback
    except RuntimeError as err:
        raise SystemExit(f"gpt2_bench.train: {err}") from None
    os.environ.setdefault(COMMAND_ENV, shlex.join(["python", "-m", "gpt2_bench.train",
                                                   *(sys.argv[1:] if argv is None else argv)]))
    from gpt2_bench.launch import run

    result = run(cfg)
    print(json.dumps({k: v for k, v in result.items() if k != "curve"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
