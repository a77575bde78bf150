"""Wrap the model with the chosen FSDP flavour (SimpleFSDP, FSDP2, FSDP1) or DDP, install the comm hook, compile."""

from __future__ import annotations

from gpt2_bench.config import REDUCE_DTYPES, TrainConfig


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


def make_hook(cfg: TrainConfig):
    """The ``tagc.hook(...)`` ``cfg`` asks for (:meth:`TrainConfig.hook_arguments`), or ``None`` where the gradient
    goes as the wrapper reduces it (``compression="none"`` with ``transport="gloo"``)."""
    arguments = cfg.hook_arguments()
    if arguments is None:
        return None
    import tagc

    return tagc.hook(**arguments)


def hsdp_mesh(cfg: TrainConfig, world: int, device):
    """``cfg.hsdp``'s 2-D ``(replicate, shard)`` mesh: replicate across hosts, shard within one (torchrun numbers
    a host's ranks consecutively); ``None`` without ``hsdp``."""
    if not cfg.hsdp:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (cfg.hosts, world // cfg.hosts), mesh_dim_names=("replicate", "shard"))


def shard(model, cfg: TrainConfig, world: int, device=None):
    """Wrap ``model`` with the chosen FSDP flavour (or DDP: :mod:`gpt2_bench.layout_ddp`) and install the comm hook;
    returns (model, hook). ``model`` is already on ``device`` (default: the CPU); the mesh and FSDP1 get its type."""
    import torch

    device = torch.device("cpu") if device is None else torch.device(device)

    import tagc

    if cfg.integration == "ddp":
        from gpt2_bench.layout_ddp import wrap_ddp

        return wrap_ddp(model, cfg, world, device, None if cfg.torch_hook else make_hook(cfg))
    hook = make_hook(cfg)
    reduce_dtype = getattr(torch, REDUCE_DTYPES[cfg.reduce_dtype]) if cfg.reduce_dtype else None
    param_dtype = getattr(torch, REDUCE_DTYPES[cfg.param_dtype]) if cfg.param_dtype else None
    if param_dtype is not None and reduce_dtype is None:
        reduce_dtype = torch.float32  # torchtitan's policy: gather in bf16, reduce in fp32
    if cfg.integration == "simple":
        from fsdp_integration import MixedPrecisionPolicy, simple_fsdp

        # one unit per transformer block + the root, like fsdp2 below; on the CPU bf16-gathered weights compute in fp32
        on_cpu = device is None or torch.device(device).type == "cpu"
        compute_dtype = torch.float32 if param_dtype is not None and on_cpu else None
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, compute_dtype=compute_dtype)
        model = simple_fsdp(model, mesh=hsdp_mesh(cfg, world, device), mp_policy=policy, overlap=cfg.overlap)
    elif cfg.integration == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = hsdp_mesh(cfg, world, device) if cfg.hsdp else init_device_mesh(device.type, (world,))
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision

        precision = MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype) if reduce_dtype else None
        model = FSDP(model, device_id=device, auto_wrap_policy=fsdp1_wrap_policy(model), mixed_precision=precision)
    if hook is not None:
        tagc.register_comm_hook(model, hook)
    return model, hook


def compiled(model, cfg: TrainConfig):
    import torch

    if cfg.integration == "simple":
        from fsdp_integration import CompileSettings, compile_model

        return compile_model(model, CompileSettings())
    return torch.compile(model)
