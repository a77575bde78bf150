"""Train GPT-2 with sharded data parallelism on one machine, optionally over an emulated link.

``python -m gpt2_bench.train --integration fsdp2 --compression non-attn --link 10gbit``
launches ``--world`` gloo ranks as subprocesses (inside a shaped network namespace when
``--link`` is given), trains with AdamW (warmup + cosine), evaluates periodically, and writes
a JSON line per step plus a summary. Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) it runs
as one rank directly, unchanged.

``--link scaled`` picks the rate that keeps the TAGC paper's compute-to-communication
ratio: these CPUs compute far slower than the paper's GPUs, so the link is slowed until the
plain gradient exchange takes the share of a step it took in the paper, measured from two
short calibration runs (unshaped, then shaped at a first guess; see :func:`scaled_link`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Sequence

INTEGRATIONS = ("simple", "fsdp2", "fsdp1")
COMPRESSIONS = ("none", "all", "non-attn")
TRANSPORTS = ("fair", "gloo")
DEVICES = ("auto", "cpu", "cuda")
REDUCE_DTYPES = {None: None, "bf16": "bfloat16"}

PAPER_LINK_BPS = 10 * 10**9
PAPER_EXCHANGE_SHARE = 0.31
"""Share of the paper's FSDP iteration spent in the gradient exchange, from its own table:
TAGC cut exchange ms/MB from 0.76 to 0.51 (x0.67) and the iteration from 25.2 to 22.6, so
the exchange was 2.6 / (1 - 0.67) = 7.9 of 25.2 units. ``--link scaled`` reproduces it."""


@dataclasses.dataclass
class TrainConfig:
    """Every knob of one training run (validated in ``__post_init__``)."""

    preset: str = "small"
    integration: str = "simple"
    compression: str = "non-attn"
    transport: str = "fair"
    codec: str = "tagc"
    """How the selected (``compression``) columns cross the wire: a name of
    :func:`tagc.hooks.codec_registry.codec_names` (``tagc``, ``topk``, ``bf16``, ...)."""
    codec_options: dict = dataclasses.field(default_factory=dict)
    """The codec's own options, e.g. ``{"block": 128}`` for ``int4``."""
    plain: str = "fp32"
    """The codec of the columns not compressed (``tagc.hook(plain=...)``): fp32, bf16, fp8 or int4."""
    reduce_dtype: Optional[str] = None
    """FSDP's own reduce dtype (``"bf16"``: gradients reduce-scattered in bfloat16, as
    ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``); ``None``: the parameters' (fp32)."""
    ratio: float = 10.0
    index_bits: int = 1
    sparsity: Any = "auto"
    min_compress_numel: int = 65536
    dense_steps: int = 0
    steps: int = 40
    batch_size: int = 4
    block_size: Optional[int] = None
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_steps: int = 5
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_interval: int = 20
    eval_batches: int = 4
    seed: int = 1337
    compile: bool = False
    compile_backend: str = "inductor"
    world: int = 2
    threads: int = 1
    link: str = "none"
    link_share: float = PAPER_EXCHANGE_SHARE
    """With ``link="scaled"``: the share of a non-overlapped plain step the plain exchange takes on
    the scaled link (the paper's 0.31 by default; about 0.9 for an H100-class GPU over 10 GbE). Past
    what the exchange can take while the all-gathers share the link, the link-bound time gets it."""
    dataset: str = "bbc"
    cache_dir: Optional[str] = None
    out_dir: str = "bench_out/gpt2"
    name: Optional[str] = None
    group_timeout_s: float = 600.0
    """How long a rank waits on a collective before it gives up (detects hangs and dead peers;
    not a limit on the run)."""
    max_time_s: Optional[float] = None
    """Stop cleanly (checkpointing first, when checkpoints are on) once a run has trained this long; None: no limit."""
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    """Write a sharded checkpoint (:mod:`gpt2_bench.checkpoint`) every this many steps (0: never)."""
    resume: bool = False
    """Continue from the newest complete checkpoint in ``checkpoint_dir`` (from scratch if there is none)."""
    fault_step: Optional[int] = None
    """Fault drill: the last rank kills itself (SIGKILL) in the middle of this step."""
    keep_freed_memory: bool = True
    """glibc keeps freed memory for reuse (:func:`keep_freed_memory`): faster steps, peak RSS stays resident."""
    overlap: bool = True
    """Each unit's reduce-scatter overlaps the backward of the units before it (SimpleFSDP eager, FSDP2)."""
    device: str = "auto"
    """``cuda``: one GPU per rank (``LOCAL_RANK``), NCCL for CUDA tensors (``cpu:gloo,cuda:nccl``: gloo
    for the few CPU ones), bf16 autocast; ``cpu``: gloo; ``auto``: ``cuda`` when a GPU is visible."""

    def __post_init__(self) -> None:
        from gpt2_bench.model import PRESETS

        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        for field, allowed in (("integration", INTEGRATIONS), ("compression", COMPRESSIONS), ("transport", TRANSPORTS),
                               ("device", DEVICES)):
            if getattr(self, field) not in allowed:
                raise ValueError(f"{field} must be one of {allowed}, got {getattr(self, field)!r}")
        if self.transport == "gloo" and self.compression != "none":
            raise ValueError("transport='gloo' (FSDP's own reduce-scatter) only applies to compression='none'")
        for field in ("steps", "batch_size", "world", "threads", "eval_interval", "eval_batches"):
            if not isinstance(getattr(self, field), int) or getattr(self, field) < 1:
                raise ValueError(f"{field} must be a positive integer, got {getattr(self, field)!r}")
        if self.warmup_steps < 0 or not 0 < self.lr or not 0 <= self.min_lr <= self.lr:
            raise ValueError("need warmup_steps >= 0 and 0 <= min_lr <= lr, lr > 0")
        if self.compression != "none":
            from tagc.hooks.codec_registry import resolve_options, spec

            if spec(self.codec).uses_config:
                import tagc

                tagc.TAGCConfig(ratio=self.ratio, index_bits=self.index_bits, sparsity=self.sparsity)  # validates
            resolve_options(self.codec, self.codec_options)
        from tagc.hooks.engine import PLAIN_CODECS

        if self.plain not in PLAIN_CODECS:
            raise ValueError(f"plain must be one of {tuple(PLAIN_CODECS)}, got {self.plain!r}")
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype must be one of {tuple(REDUCE_DTYPES)}, got {self.reduce_dtype!r}")
        if self.checkpoint_every < 0 or (self.checkpoint_every and not self.checkpoint_dir):
            raise ValueError(f"checkpoint_every must be >= 0 and needs checkpoint_dir, got {self.checkpoint_every!r}")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume needs checkpoint_dir (where the checkpoints are)")
        for field in ("group_timeout_s", "max_time_s"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise ValueError(f"{field} must be a positive number of seconds, got {value!r}")
        if not 0 < self.link_share < 1:
            raise ValueError(f"link_share must be a fraction in (0, 1), got {self.link_share!r}")
        if self.link not in ("none", "scaled"):
            from tagc.link import parse_rate

            parse_rate(self.link)

    @property
    def run_name(self) -> str:
        if self.name:
            return self.name
        from tagc.hooks.codec_registry import spec

        if self.compression == "none":
            algo = "fsdp"
        elif spec(self.codec).uses_config:
            algo = f"{self.codec}-{self.compression}-r{self.ratio:g}" + (f"-b{self.index_bits}" if self.codec == "tagc" else "")
        else:
            algo = f"{self.codec}-{self.compression}"
        algo += "".join(f"-{key}{value}" for key, value in sorted(self.codec_options.items()))
        if self.plain != "fp32":
            algo += f"-plain{self.plain}"
        if self.reduce_dtype:
            algo += f"-reduce-{self.reduce_dtype}"
        if self.compression != "none" and self.dense_steps:
            algo += f"-dense{self.dense_steps}"
        return f"{self.integration}{'-compiled' if self.compile else ''}-{algo}{'' if self.overlap else '-no-overlap'}"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def resolve_device(choice: str) -> tuple[str, str]:
    """``--device`` -> ``(device type, process-group backend)``: ``("cuda", "cpu:gloo,cuda:nccl")``
    (NCCL for CUDA tensors, gloo for CPU ones such as ``all_gather_object``'s) or ``("cpu", "gloo")``.
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
        raise RuntimeError(f"--device cuda: no CUDA device is available: {built}. Use --device cpu (or auto).")
    if not torch.distributed.is_nccl_available():
        raise RuntimeError("--device cuda: this torch has no NCCL; the GPU ranks need it")
    return "cuda", "cpu:gloo,cuda:nccl"


def local_rank(rank: int) -> int:
    """This rank's GPU on its node: ``LOCAL_RANK`` under torchrun (several nodes too), else the rank
    (:func:`run` starts every rank on this machine)."""
    return int(os.environ.get("LOCAL_RANK", rank))


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warmup, then cosine decay to ``min_lr`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (cfg.lr - cfg.min_lr)


# ----------------------------------------------------------------------------- one rank


def fsdp1_wrap_policy(model):
    """FSDP1 auto-wrap policy: every Linear (but the tied ``lm_head``) and every Block is a unit.

    FSDP1 can only select whole units for compression, so the linears get units of their own;
    ``lm_head`` stays in the root with the embedding it is tied to.
    """
    import torch.nn as nn

    from gpt2_bench.model import Block

    linears = {m for name, m in model.named_modules() if isinstance(m, nn.Linear) and name != "lm_head"}

    def policy(module, recurse: bool, nonwrapped_numel: int) -> bool:
        return recurse or module in linears or isinstance(module, Block)

    return policy


def _shard(model, cfg: TrainConfig, world: int, device=None):
    """Wrap ``model`` with the chosen FSDP flavour and install the comm hook; returns (model, hook).
    ``model`` is already on ``device`` (default: the CPU); the mesh and FSDP1 get its type."""
    import torch

    device = torch.device("cpu") if device is None else torch.device(device)

    import tagc

    hook = None
    if cfg.compression != "none" or cfg.transport == "fair":
        select = {"none": "none", "all": "all", "non-attn": "non_attention_linear"}[cfg.compression]
        from tagc.hooks.codec_registry import spec

        codec = "plain" if cfg.compression == "none" else cfg.codec
        tagc_settings = dict(ratio=cfg.ratio, index_bits=cfg.index_bits, sparsity=cfg.sparsity) if spec(codec).uses_config else {}
        hook = tagc.hook(select=select, min_compress_numel=cfg.min_compress_numel, dense_steps=cfg.dense_steps,
                         codec=codec, overlap=cfg.overlap, plain=cfg.plain, **tagc_settings, **cfg.codec_options)
    reduce_dtype = getattr(torch, REDUCE_DTYPES[cfg.reduce_dtype]) if cfg.reduce_dtype else None
    if cfg.integration == "simple":
        from fsdp_integration import MixedPrecisionPolicy, simple_fsdp

        # one unit per transformer block + the root, like fsdp2 below
        model = simple_fsdp(model, mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce_dtype), overlap=cfg.overlap)
    elif cfg.integration == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (world,))
        policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision

        model = FSDP(model, device_id=device, auto_wrap_policy=fsdp1_wrap_policy(model),
                     mixed_precision=MixedPrecision(reduce_dtype=reduce_dtype) if reduce_dtype else None)
    if hook is not None:
        tagc.register_comm_hook(model, hook)
    return model, hook


def _compiled(model, cfg: TrainConfig):
    import torch

    if cfg.integration == "simple":
        from fsdp_integration import CompileSettings, compile_model

        return compile_model(model, CompileSettings(backend=cfg.compile_backend))
    return torch.compile(model, backend=cfg.compile_backend)


def _rss_mb() -> float:
    """This process's resident memory now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    """This process's peak resident memory (the CPU stand-in for peak device memory)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _evaluate(model, data, cfg: TrainConfig, rank: int, world: int, block_size: int, device=None) -> float:
    import torch
    import torch.distributed as dist

    device = torch.device("cpu") if device is None else device
    gen = torch.Generator().manual_seed(cfg.seed + 999)
    model.eval()
    total = torch.zeros(1, device=device)
    with torch.no_grad(), _autocast(device):
        for _ in range(cfg.eval_batches):
            x, y = data.get_batch("val", cfg.batch_size, block_size, gen, device=device, rank=rank, world_size=world)
            total += model(x, y)[1].detach().float()
    model.train()
    dist.all_reduce(total)
    return float(total) / (cfg.eval_batches * world)


HEAP_KEEP_BYTES = 256 << 20


def keep_freed_memory() -> bool:
    """Have glibc keep freed tensors' memory for reuse instead of returning it to the kernel.

    By default glibc ``mmap``s large blocks and ``munmap``s them on free (and trims the heap),
    so every step's activations and gradients fault their pages in again, and its dynamic
    threshold shifts as the run goes on. On 2 CPU cores that cost a plain FSDP step 25-30%
    (2.6-3.0 s against 2.0 s) and made steps drift slower over a run. Blocks below
    :data:`HEAP_KEEP_BYTES` now come from the heap, which is never trimmed: the resident size
    stays at its peak. Applies to this process (every rank calls it, also under ``torchrun``);
    returns False where the C library is not glibc.
    """
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


def _sync(device) -> None:
    """Wait for the GPU before reading the clock (step times); nothing on the CPU."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timeline(start: float, backward: float, backward_end: float, end: float, units: list[dict]) -> dict:
    """One step's spans in ms from its start: forward, backward, optimizer, and per unit its wire
    and its codec / wait spans on the training thread (from :meth:`tagc.TAGCHook.stats`)."""
    ms = lambda t: round((t - start) * 1e3, 2)  # noqa: E731
    return {"forward": [0.0, ms(backward)], "backward": [ms(backward), ms(backward_end)], "optimizer": [ms(backward_end), ms(end)],
            "units": [{"unit": u["unit"], "events": [[kind, ms(a), ms(b)] for kind, a, b in u["events"]]} for u in units]}


def worker(cfg: TrainConfig, rank: int, world: int, data_dir: str, log_path: str) -> None:
    """Train on one rank (process group already initialised); rank 0 writes the log."""
    import torch
    import torch.distributed as dist

    from gpt2_bench.data import TokenData
    from gpt2_bench.model import GPT, GPTConfig

    torch.set_num_threads(cfg.threads)
    if cfg.keep_freed_memory:
        keep_freed_memory()
    device_type, _ = resolve_device(cfg.device)
    device = torch.device(device_type, local_rank(rank)) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(cfg.seed)
    model_cfg = GPTConfig.preset(cfg.preset, **({"block_size": cfg.block_size} if cfg.block_size else {}))
    model = GPT(model_cfg).to(device)
    n_params = model.num_params()
    grad_mb = n_params * 4 / 2**20  # the unsharded fp32 gradient, counted before sharding
    model, hook = _shard(model, cfg, world, device)
    step_fn = _compiled(model, cfg) if cfg.compile else model
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr)
    data = TokenData(data_dir)
    gen = torch.Generator().manual_seed(cfg.seed)
    first_step = _restore(cfg, model, opt, hook, gen)
    log = _open_log(log_path, first_step) if rank == 0 else None
    progress = None
    if rank == 0:
        from tqdm.auto import tqdm

        progress = tqdm(total=cfg.steps, initial=first_step, desc=cfg.run_name, unit="step", file=sys.stderr, leave=False)
    start = time.perf_counter()
    val_loss = float("nan")
    forward_rss_mb = None
    stopped_at = None
    for step in range(first_step, cfg.steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(cfg, step)
        _sync(device)
        tick = time.perf_counter()
        x, y = data.get_batch("train", cfg.batch_size, model_cfg.block_size, gen, device=device, rank=rank, world_size=world)
        with _autocast(device):
            _, loss = step_fn(x, y)
        if step == cfg.steps - 1:
            forward_rss_mb = _rss_mb()  # what forward left alive for backward (resharding frees gathered weights)
        if step == cfg.fault_step and rank == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        _sync(device)
        forward_s = time.perf_counter() - tick
        loss.backward()
        _sync(device)
        backward_s = time.perf_counter() - tick - forward_s
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        iter_s = time.perf_counter() - tick
        record = {"step": step, "loss": float(loss.detach()), "lr": learning_rate(cfg, step), "iter_ms": iter_s * 1e3,
                  "forward_ms": forward_s * 1e3, "backward_ms": backward_s * 1e3,
                  "elapsed_s": time.perf_counter() - start, "tokens": (step + 1) * cfg.batch_size * model_cfg.block_size * world}
        if hook is not None:
            hook.end_step()
            stats = hook.stats()
            last = stats["last_step"]
            exchange_s = last["compress_s"] + last["exposed_s"] + last["decode_s"]  # the step's time on the exchange
            record.update(exchange_ms=exchange_s * 1e3, exchange_ms_per_mb=exchange_s * 1e3 / grad_mb,
                          compress_ms=last["compress_s"] * 1e3, exposed_ms=last["exposed_s"] * 1e3,
                          wire_ms=last["wire_s"] * 1e3, decode_ms=last["decode_s"] * 1e3,
                          wire_bytes=last["wire_bytes"], plain_bytes=last["plain_equivalent_bytes"],
                          peel_success=last["peel_success"], unpeeled=last["unpeeled"],
                          units={u["unit"]: {"wire_ms": u["wire_s"] * 1e3, "exposed_ms": u["exposed_s"] * 1e3,
                                             "bytes": u["wire_bytes"]} for u in stats["units"]})
            if step == cfg.steps - 2:  # a steady step's timeline, for the picture
                record["timeline"] = timeline(tick, tick + forward_s, tick + forward_s + backward_s, tick + iter_s, stats["units"])
        if (step + 1) % cfg.eval_interval == 0 or step + 1 == cfg.steps:
            val_loss = _evaluate(model, data, cfg, rank, world, model_cfg.block_size, device)
            record["val_loss"] = val_loss
        if log is not None:
            log.write(json.dumps(record) + "\n")
            log.flush()
            progress.update(1)
            progress.set_postfix(loss=f"{record['loss']:.3f}", ms=f"{record['iter_ms']:.0f}")
        out_of_time = cfg.max_time_s is not None and _any_rank(time.perf_counter() - start > cfg.max_time_s, device)
        if cfg.checkpoint_every and ((step + 1) % cfg.checkpoint_every == 0 or out_of_time):
            from gpt2_bench import checkpoint

            checkpoint.save(cfg.checkpoint_dir, step + 1, model, opt, hook, gen)
        if out_of_time:
            stopped_at = step + 1
            break
    if rank == 0:
        progress.close()
        total = hook.stats()["total"] if hook is not None else None
        log.write(json.dumps({"summary": True, "n_params": n_params, "grad_mb": grad_mb, "val_loss": val_loss, "hook_total": total,
                              "peak_rss_mb": _peak_rss_mb(), "forward_rss_mb": forward_rss_mb, "first_step": first_step,
                              "stopped_at": stopped_at, "device": str(device),
                              **({"peak_gpu_mb": torch.cuda.max_memory_allocated(device) / 2**20} if device.type == "cuda" else {})})
                  + "\n")
        log.close()
    dist.barrier()


def _restore(cfg: TrainConfig, model, opt, hook, gen) -> int:
    """With ``resume``, load the newest complete checkpoint; returns the first step to train."""
    if not cfg.resume:
        return 0
    from gpt2_bench import checkpoint

    path = checkpoint.latest(cfg.checkpoint_dir)
    if path is None:
        print(f"no complete checkpoint in {cfg.checkpoint_dir}: training from step 0", file=sys.stderr)
        return 0
    first_step = checkpoint.load(path, model, opt, hook, gen)
    print(f"resumed from {path} (step {first_step})", file=sys.stderr)
    return first_step


def _open_log(log_path: str, first_step: int):
    """The step log, for appending: a resumed run keeps the records of the steps it does not redo."""
    if first_step == 0:
        return open(log_path, "w")
    path = Path(log_path)
    kept = [line for line in (path.read_text().splitlines() if path.exists() else [])
            if line.strip() and json.loads(line).get("step", math.inf) < first_step]
    path.write_text("".join(line + "\n" for line in kept))
    return open(log_path, "a")


def _any_rank(flag: bool, device=None) -> bool:
    """Whether ``flag`` is true on some rank (a collective: every rank decides alike). The flag
    travels on ``device`` (the ranks' device: NCCL takes no CPU tensor)."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value)


def _worker_main(args: argparse.Namespace) -> None:
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable()  # a rank killed by a signal (SIGSEGV, SIGABRT) prints its Python stack

    cfg = TrainConfig(**json.loads(Path(args.config).read_text()))
    rank = int(os.environ.get("RANK", args.rank))
    world = int(os.environ.get("WORLD_SIZE", cfg.world))
    timeout = timedelta(seconds=cfg.group_timeout_s)
    try:
        device_type, backend = resolve_device(cfg.device)
    except RuntimeError as err:
        raise SystemExit(f"gpt2_bench.train (rank {rank}): {err}") from None
    if device_type == "cuda":
        import torch

        torch.cuda.set_device(local_rank(rank))  # before the group: NCCL binds each rank to its GPU
    if args.rendezvous:  # launched by run(): a file store, no port to race for
        dist.init_process_group(backend, init_method=f"file://{args.rendezvous}", rank=rank, world_size=world, timeout=timeout)
    else:  # torchrun: env://
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    try:
        worker(cfg, rank, world, args.data_dir, args.log)
    finally:
        dist.destroy_process_group()
    exit_without_teardown()


def exit_without_teardown() -> None:
    """End a finished rank at once, skipping C++ static destructors: a rank that had finished and
    destroyed its process group sometimes aborted in them ("terminate called without an active
    exception", no Python frame), failing a run that was complete. A workaround; the cause is open."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ----------------------------------------------------------------------------- launcher


def summarise(cfg: TrainConfig, log_path: Path, link: str) -> dict:
    records = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "step" in r]
    summary = next(r for r in records if r.get("summary"))
    first_steady = max(1, len(steps) // 5, cfg.dense_steps + 1 if cfg.compression != "none" else 0)
    steady = steps[min(len(steps) - 1, first_steady) :]  # drop warm-up steps and the dense warm-up
    median = lambda xs: sorted(xs)[len(xs) // 2] if xs else float("nan")  # noqa: E731
    total = summary.get("hook_total") or {}
    return {
        "name": cfg.run_name,
        "integration": cfg.integration,
        "compiled": cfg.compile,
        "algorithm": "fsdp" if cfg.compression == "none" else cfg.codec,
        "codec": None if cfg.compression == "none" else cfg.codec,
        "reduce_dtype": cfg.reduce_dtype,
        "compressed": cfg.compression,
        "transport": cfg.transport,
        "ratio": cfg.ratio if cfg.compression != "none" else None,
        "index_bits": cfg.index_bits if cfg.compression != "none" else None,
        "link": link,
        "steps": len(steps),
        "tokens": steps[-1]["tokens"] if steps else 0,
        "iter_ms": median([r["iter_ms"] for r in steady]),
        "steady_iter_ms": [r["iter_ms"] for r in steady],
        "codec_ms": median([r.get("compress_ms", 0.0) + r.get("decode_ms", 0.0) for r in steady]) if total else None,
        "train_s": sum(r["iter_ms"] for r in steps) / 1e3,  # every step, warm-up and dense steps included
        "exchange_ms_per_mb": median([r["exchange_ms_per_mb"] for r in steady if "exchange_ms_per_mb" in r]) if total else None,
        "wire_bytes_per_rank": (total.get("wire_bytes", 0) / max(1, len(steps))) if total else None,
        "plain_bytes_per_rank": (total.get("plain_equivalent_bytes", 0) / max(1, len(steps))) if total else None,
        "wire_bytes_per_step": median([r["wire_bytes"] for r in steady if "wire_bytes" in r]) if total else None,  # steady steps
        "overlap": cfg.overlap,
        "exposed_ms": median([r["exposed_ms"] for r in steady if "exposed_ms" in r]) if total else None,
        "wire_ms": median([r["wire_ms"] for r in steady if "wire_ms" in r]) if total else None,
        "units": _unit_medians(steady),
        "timeline": next((r["timeline"] for r in steps if "timeline" in r), None),
        "val_loss": summary["val_loss"],
        "resumed_from_step": summary.get("first_step") or None,
        "stopped_at": summary.get("stopped_at"),
        "peel_success": total.get("peel_success") if cfg.compression != "none" else None,
        "n_params": summary["n_params"],
        "peak_rss_mb": summary.get("peak_rss_mb"),
        "forward_rss_mb": summary.get("forward_rss_mb"),
        "grad_mb": summary["grad_mb"],
        "log": str(log_path),
        "curve": [{k: r[k] for k in ("step", "loss", "elapsed_s", "val_loss") if k in r} for r in steps],
    }


def _unit_medians(steps: list[dict]) -> dict:
    """Per unit, the median over ``steps`` of its wire ms, exposed ms and bytes."""
    names = {name for r in steps for name in r.get("units", {})}
    return {name: {field: statistics.median(r["units"][name][field] for r in steps if name in r.get("units", {}))
                   for field in ("wire_ms", "exposed_ms", "bytes")} for name in sorted(names)}


def run(cfg: TrainConfig, data_dir: Optional[str] = None, link: Optional[str] = None, attempts: int = 1) -> dict:
    """Train ``cfg`` with ``cfg.world`` subprocess ranks; returns the run's summary.

    With ``attempts > 1`` a run whose rank dies (:class:`RankFailed`) is started again, up to
    ``attempts`` times in all: from its newest complete checkpoint when ``cfg.checkpoint_dir``
    is set (the steps it does not redo keep their records; a resumed run repeats the
    uninterrupted losses bit for bit), from scratch otherwise. Benchmarks use it so that one
    rare crash (the README's "Known problem: a rare heap abort on gloo") costs minutes, not the whole sweep.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    for attempt in range(1, attempts + 1):
        try:
            return _run_once(cfg, data_dir, link)
        except RankFailed as error:
            if attempt == attempts:
                raise
            again = "from its newest checkpoint" if cfg.checkpoint_dir else "from scratch"
            print(f"{cfg.run_name}: {error}\n{cfg.run_name}: starting again {again} (attempt {attempt + 1} of {attempts})",
                  file=sys.stderr)
            cfg = dataclasses.replace(cfg, resume=bool(cfg.checkpoint_dir), fault_step=None)  # a fault drill fires once
    raise AssertionError("unreachable")


def _run_once(cfg: TrainConfig, data_dir: Optional[str], link: Optional[str]) -> dict:
    from gpt2_bench.data import prepare
    from tagc.link import ShapedLink

    data_dir = data_dir or str(prepare(cfg.dataset, cfg.cache_dir))
    link = link or cfg.link
    if link == "scaled":
        link = scaled_link(cfg, data_dir)["rate"]
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / f"{cfg.run_name}.jsonl"
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp) / "config.json"
        config_path.write_text(cfg.to_json())
        rendezvous = Path(tmp) / "rendezvous"  # a FileStore: no port to pick, so no race for one
        argvs = [[sys.executable, "-m", "gpt2_bench.train", "--worker", "--rank", str(r), "--rendezvous", str(rendezvous),
                  "--config", str(config_path), "--data-dir", data_dir, "--log", str(log_path)] for r in range(cfg.world)]
        env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads)}
        if link == "none":
            procs = [subprocess.Popen(a, env=env) for a in argvs]
            _wait(procs, cfg)
        else:
            with ShapedLink(link, world=cfg.world) as shaped:
                _wait(shaped.launch(argvs, env=env), cfg)
    return summarise(cfg, log_path, link)


class RankFailed(RuntimeError):
    """A training rank exited with an error or was killed; says which, and where to resume from."""


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _first_failure(procs: list[subprocess.Popen]) -> Optional[tuple[int, int]]:
    """``(rank, exit code)`` of a failed rank, a signal's victim before a rank that exited with an
    error (within one poll, the others' errors are usually the dead peer's consequence)."""
    failed = [(rank, proc.returncode) for rank, proc in enumerate(procs) if proc.returncode not in (None, 0)]
    return min(failed, key=lambda rc: (rc[1] > 0, rc[0])) if failed else None


def _wait(procs: list[subprocess.Popen], cfg: TrainConfig, poll_s: float = 0.2) -> None:
    """Wait for every rank. When one fails, the others get the group timeout to notice and exit
    with their own error, then are killed; the error names the first rank that failed and the
    newest complete checkpoint. With ``max_time_s`` the ranks stop themselves; a backstop kills
    them a group timeout later."""
    deadline = None if cfg.max_time_s is None else time.monotonic() + cfg.max_time_s + cfg.group_timeout_s + 60
    first_failure: Optional[tuple[int, int]] = None
    failed_at = 0.0
    try:
        while any(proc.poll() is None for proc in procs):
            now = time.monotonic()
            if first_failure is None:
                first_failure = _first_failure(procs)
                failed_at = now
            if first_failure is not None and now - failed_at > cfg.group_timeout_s:
                break
            if deadline is not None and now > deadline:
                raise RankFailed(f"training ranks did not stop within --max-time {cfg.max_time_s:.0f} s "
                                 f"plus the group timeout ({cfg.group_timeout_s:.0f} s)")
            time.sleep(poll_s)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if first_failure is None:
        first_failure = _first_failure(procs)
    if first_failure is not None:
        rank, code = first_failure
        codes = ", ".join(f"rank {r}: {_exit_reason(p.returncode) if p.returncode else 'ok'}" for r, p in enumerate(procs))
        resume = "no checkpoints were asked for (--checkpoint-dir, --checkpoint-every)"
        if cfg.checkpoint_dir:
            from gpt2_bench import checkpoint

            newest = checkpoint.latest(cfg.checkpoint_dir)
            resume = (f"newest complete checkpoint: {newest}; rerun with --resume to continue from it" if newest
                      else f"no complete checkpoint in {cfg.checkpoint_dir} yet")
        raise RankFailed(f"training rank {rank} failed first ({_exit_reason(code)}; {codes}); see its traceback above. {resume}")


def scaled_link(cfg: TrainConfig, data_dir: str, steps: int = 6) -> dict:
    """The link rate at which this machine's plain exchange takes the paper's share of a step.

    Two short uncompressed calibration runs with the fair plain exchange. The step at rate
    ``r`` is modelled as ``T(r) = A + C / r`` — compute, plus everything the link slows,
    the all-gathers as well as the exchange — and the exchange as ``E(r) = V / r``. The
    unshaped run gives ``A`` (its step minus its exchange) and a first guess, the rate at
    which the exchange alone would be the paper's share; a run shaped at that guess gives
    ``C`` and ``V``; the rate solves ``E(r) / T(r) = share``. (The guess alone undershoots:
    shaping also slows the all-gathers, so there the exchange takes less than the share.)

    The exchange alone can take at most ``V / C`` of a step, since the all-gathers cross the
    same link (about half here). A larger share (0.9: a GPU over 10 GbE, where the all-gathers
    cross the slow link too) is given to the link-bound time instead: ``(C/r) / T(r) = share``;
    ``share_of`` says which, and ``modelled_exchange_share`` what the exchange alone then takes.
    """
    from tagc.link import format_rate

    share = cfg.link_share
    probe = dataclasses.replace(cfg, compression="none", transport="fair", steps=steps, eval_interval=10**6, reduce_dtype=None,
                                link="none", name=f"calibrate-{cfg.preset}", overlap=False, checkpoint_every=0, resume=False)  # the share of a non-overlapped step

    def measure(rate: str) -> tuple[float, float, float]:
        result = run(probe, data_dir, link=rate)
        return result["iter_ms"] / 1e3, result["exchange_ms_per_mb"] * result["grad_mb"] / 1e3, result["wire_bytes_per_rank"]

    step_s, exchange_s, wire_bytes = measure("none")
    compute_s = max(1e-3, step_s - exchange_s)
    guess_bps = max(10**6, int(wire_bytes * 8 / (compute_s * share / (1 - share))))
    shaped_step_s, shaped_exchange_s, _ = measure(format_rate(guess_bps))
    slowed = max(0.0, shaped_step_s - compute_s) * guess_bps  # C: link-bound seconds x bit/s
    exchange = shaped_exchange_s * guess_bps  # V
    if exchange > share * slowed:
        share_of = "exchange"
        rate_bps = max(10**6, int((exchange - share * slowed) / (share * compute_s)))
    else:  # the all-gathers cross the link too, so the exchange alone never takes this share: give it to the link's time
        share_of = "link"
        rate_bps = max(10**6, int(slowed * (1 - share) / (share * compute_s)))
    exchange_share = exchange / rate_bps / (compute_s + slowed / rate_bps)
    info = {"rate": format_rate(rate_bps), "rate_bps": rate_bps, "cpu_step_ms": step_s * 1e3, "rest_ms": compute_s * 1e3,
            "exchange_share": share, "share_of": share_of, "modelled_exchange_share": exchange_share,
            "slowdown": PAPER_LINK_BPS / rate_bps, "nominal": "10gbit",
            "first_guess": format_rate(guess_bps), "first_guess_share": shaped_exchange_s / shaped_step_s}
    what = ("the plain exchange takes" if share_of == "exchange" else
            f"the link-bound time (exchange and all-gathers; the exchange alone cannot: {exchange_share:.0%}) takes")
    print(f"scaled link: a step here computes for {compute_s * 1e3:.0f} ms; at {info['first_guess']} the plain exchange "
          f"took {info['first_guess_share']:.0%} of a step; {what} {share:.0%} at {info['rate']} "
          f"(10gbit / {info['slowdown']:.0f})", file=sys.stderr)
    return info


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gpt2_bench.train", description=__doc__.split("\n\n")[0])
    defaults = TrainConfig()
    p.add_argument("--preset", default=defaults.preset, help="model preset: tiny, small, gpt2, gpt2-untied")
    p.add_argument("--integration", default=defaults.integration, choices=INTEGRATIONS)
    p.add_argument("--compression", default=defaults.compression, choices=COMPRESSIONS)
    p.add_argument("--transport", default=defaults.transport, choices=TRANSPORTS,
                   help="plain exchange for --compression none: fair all-to-all (default) or FSDP's own gloo reduce-scatter")
    p.add_argument("--codec", default=defaults.codec,
                   help="how the --compression columns cross the wire: tagc (default), topk, bf16, fp8, int4, sign, powersgd")
    p.add_argument("--codec-option", dest="codec_options", action="append", default=[], metavar="NAME=VALUE",
                   help="a codec option, e.g. --codec int4 --codec-option block=128 (repeatable)")
    p.add_argument("--plain", default=defaults.plain, choices=("fp32", "bf16", "fp8", "int4"),
                   help="the codec of the columns not compressed (attention, biases, norms, embeddings by default)")
    p.add_argument("--reduce-dtype", default=None, choices=[d for d in REDUCE_DTYPES if d],
                   help="FSDP's own gradient reduce dtype (bf16: MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))")
    p.add_argument("--ratio", type=float, default=defaults.ratio)
    p.add_argument("--index-bits", type=int, default=defaults.index_bits, choices=(1, 4))
    p.add_argument("--sparsity", default="auto", help="fraction zeroed before encoding, or 'auto'")
    for field in ("steps", "batch_size", "block_size", "eval_interval", "eval_batches", "seed", "world", "threads", "warmup_steps",
                  "min_compress_numel", "dense_steps"):
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=getattr(defaults, field))
    p.add_argument("--device", default=defaults.device, choices=DEVICES,
                   help="cuda: one GPU per rank (LOCAL_RANK), NCCL, bf16 autocast; cpu: gloo; auto (default): cuda when a GPU is visible")
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--group-timeout", dest="group_timeout_s", type=float, default=defaults.group_timeout_s,
                   help="seconds a rank waits on a collective before failing (detects hangs and dead ranks; default %(default)s)")
    p.add_argument("--max-time", dest="max_time_s", type=float, default=None,
                   help="stop cleanly after this many seconds of training (checkpointing first with --checkpoint-every); "
                        "default: no limit")
    p.add_argument("--checkpoint-dir", default=None, help="where sharded checkpoints go (one step-<N> directory each)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="write a checkpoint every this many steps (0: never)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --checkpoint-dir")
    p.add_argument("--fault-step", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--return-freed-memory", dest="keep_freed_memory", action="store_false",
                   help="let glibc return freed memory to the kernel (its default: slower steps here, but RSS "
                        "measures live memory); by default the ranks keep it for reuse")
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="wait for each unit's reduce-scatter in its backward (by default it overlaps the backward of the "
                        "units before it and all finish at the end of backward)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (simple: fullgraph, Inductor bucketing)")
    p.add_argument("--compile-backend", default=defaults.compile_backend, help="inductor (default), aot_eager, ...")
    p.add_argument("--link", default=defaults.link, help="none, scaled, or a rate such as 10gbit, 1gbit, 100mbit")
    p.add_argument("--share", dest="link_share", type=float, default=defaults.link_share,
                   help="--link scaled: the plain exchange's share of a non-overlapped plain step on the scaled link "
                        "(default %(default)s, the paper's; 0.9 for an H100-class GPU over 10 GbE)")
    p.add_argument("--dataset", default=defaults.dataset, help="bbc (offline default), openwebtext, or a local file")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--out-dir", default=defaults.out_dir)
    p.add_argument("--name", default=None)
    # internal: one rank
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--rendezvous", default=None, help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--data-dir", help=argparse.SUPPRESS)
    p.add_argument("--log", help=argparse.SUPPRESS)
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    sparsity = args.sparsity if args.sparsity == "auto" else float(args.sparsity)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields}
    values["sparsity"] = sparsity
    values["codec_options"] = parse_codec_options(args.codec_options)
    return TrainConfig(**values)


def parse_codec_options(pairs: Sequence[str]) -> dict:
    """``["block=128", "stochastic=true"]`` -> ``{"block": 128, "stochastic": True}``."""
    options = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"--codec-option takes NAME=VALUE, got {pair!r}")
        lowered = text.lower()
        if lowered in ("true", "false"):
            options[name] = lowered == "true"
        else:
            try:
                options[name] = int(text)
            except ValueError:
                try:
                    options[name] = float(text)
                except ValueError:
                    options[name] = text
    return options


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
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        from gpt2_bench.data import prepare

        Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
        args.config = str(Path(cfg.out_dir) / f"{cfg.run_name}.config.json")
        Path(args.config).write_text(cfg.to_json())
        args.data_dir = str(prepare(cfg.dataset, cfg.cache_dir, progress=os.environ["RANK"] == "0"))
        args.log = str(Path(cfg.out_dir) / f"{cfg.run_name}.jsonl")
        _worker_main(args)
        return 0
    result = run(cfg)
    print(json.dumps({k: v for k, v in result.items() if k != "curve"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
