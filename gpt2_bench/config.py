"""One training run's settings: :class:`TrainConfig` (validated) and the command line that fills it."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
from typing import Any, Optional, Sequence

from testbed.paper import EXCHANGE_SHARE

INTEGRATIONS = ("simple", "fsdp2", "fsdp1", "ddp")
HSDP_INTEGRATIONS = ("fsdp2", "simple")
"""The integrations with an HSDP layout (``hsdp``: a 2-D mesh, sharded within a host, replicated across hosts)."""
COMPRESSIONS = ("none", "all", "non-attn", "blocks")
TRANSPORTS = ("fair", "gloo")
DEVICES = ("auto", "cpu", "cuda", "cuda-shared")
REDUCE_DTYPES = {None: None, "bf16": "bfloat16"}
"""``--reduce-dtype`` and ``--param-dtype``: FSDP's gradient reduce and parameter all-gather dtypes."""



@dataclasses.dataclass
class TrainConfig:
    """Every knob of one training run (validated in ``__post_init__``). A field with a command-line flag is
    described by that flag's help (:func:`build_parser`); the docstrings below say what the help does not."""

    preset: str = "small"
    integration: str = "simple"
    compression: str = "non-attn"
    transport: str = "fair"
    codec: str = "tagc"
    codec_options: dict = dataclasses.field(default_factory=dict)
    plain: Optional[str] = None
    """``None`` (also ``ratio``, ``feedback``, ``feedback_decay``, ``dense_steps``, and codec options not given): the
    library's default for the codec, filled in when the config is made (:meth:`fill_library_defaults`)."""
    reduce_dtype: Optional[str] = None
    param_dtype: Optional[str] = None
    ratio: Optional[float] = None
    index_bits: int = 1
    sparsity: float | str = "auto"
    """tagc's and topk's share of entries each rank holds back (:class:`tagc.config.TAGCConfig`)."""
    min_compress_numel: int = 65536
    dense_steps: Optional[int] = None
    feedback: Optional[str] = None
    feedback_decay: Optional[float] = None
    feedback_decay_follows_lr: bool = False
    steps: int = 40
    batch_size: int = 4
    block_size: Optional[int] = None
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_steps: int = 5
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_interval: int = 20
    eval_tokens: int = 8192
    """Val tokens in windows spread evenly over the val split, alike for every run
    (:meth:`gpt2_bench.data.TokenData.eval_batches`)."""
    seed: int = 1337
    """The model's initialisation and the order of the training windows
    (:meth:`gpt2_bench.data.TokenData.train_batch`)."""
    compile: bool = False
    world: int = 2
    """Ranks in all (``hosts`` x ranks per host)."""
    hosts: int = 1
    hierarchy: str = "auto"
    hsdp: bool = False
    torch_hook: bool = False
    threads: int = 1
    link: str = "none"
    link_share: float = EXCHANGE_SHARE
    dataset: str = "bbc"
    cache_dir: Optional[str] = None
    out_dir: str = "bench_out/gpt2"
    name: Optional[str] = None
    group_timeout_s: float = 600.0
    max_time_s: Optional[float] = None
    stop_at: Optional[int] = None
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 0
    resume: bool = False
    fault_step: Optional[int] = None
    """Fault drill: the last rank kills itself (SIGKILL) in the middle of this step."""
    overlap: bool = True
    diagnostics: bool = False
    library_filled: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    """Name -> ``(given, filled)`` for each codec setting the library filled in, so that a copy leaves it to the
    library again, for the copy's codec. Not part of the run's settings (:meth:`to_json` leaves it out)."""
    device: str = "auto"

    def fill_library_defaults(self) -> None:
        """Set the codec settings left unset to the library's, so that the run's settings record them. One filled
        in before (a copy's) that still holds the filled value is unset first: a copy with codec ``topk`` gets
        topk's defaults, not tagc's."""
        for name, (given, filled) in self.library_filled.items():
            if getattr(self, name) == filled:
                setattr(self, name, copy.deepcopy(given))
        resolved = library_codec_settings(self)
        if self.dense_steps is None:
            resolved["dense_steps"] = library_dense_steps(self.codec, self.compression)
        self.library_filled = {name: (copy.deepcopy(getattr(self, name)), value) for name, value in resolved.items()
                               if getattr(self, name) != value}
        for name, value in resolved.items():
            setattr(self, name, value)

    def as_given(self) -> dict[str, Any]:
        """The codec settings the library filled in, back to what was given (``None``), and no record of them."""
        return {**{name: copy.deepcopy(given) for name, (given, _) in self.library_filled.items()},
                "library_filled": {}}

    def copy_with(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes``, whose codec settings the library fills in afresh for the copy's codec, where
        neither this config's caller nor ``changes`` gave them: unlike ``dataclasses.replace``, no value in
        ``changes`` is taken for a copied filled one."""
        return dataclasses.replace(self, **{**self.as_given(), **changes})

    def hook_arguments(self) -> dict[str, Any] | None:
        """The keyword arguments of the ``tagc.hook(...)`` this run installs (its codec, selection, warm-up, wire
        settings), or ``None`` where the gradient goes as the wrapper reduces it (``compression="none"`` with
        ``transport="gloo"``)."""
        if self.compression == "none" and self.transport != "fair":
            return None
        from tagc.hooks.codecs.registry import spec

        select = {"none": "none", "all": "all", "non-attn": "non_attention_linear",
                  "blocks": "non_attention_block_linear"}[self.compression]
        codec = "plain" if self.compression == "none" else self.codec
        fields = spec(codec).config_fields
        given = (("ratio", self.ratio), ("index_bits", self.index_bits), ("sparsity", self.sparsity))
        sketch = {name: value for name, value in given if name in fields}
        return dict(select=select, min_compress_numel=self.min_compress_numel, dense_steps=self.dense_steps,
                    codec=codec, overlap=self.overlap, plain=self.plain, feedback=self.feedback,
                    feedback_decay=self.feedback_decay, hierarchy=self.hierarchy, **sketch,
                    **self.codec_options)  # ranks per host: torchrun's

    def __post_init__(self) -> None:
        from gpt2_bench.model import PRESETS

        self.fill_library_defaults()
        if self.feedback_decay_follows_lr and not (self.feedback == "ef21" and self.feedback_decay < 1.0):
            raise ValueError("feedback_decay_follows_lr scales EF21's fading with the learning rate: it needs "
                             f"feedback='ef21' and feedback_decay < 1, got feedback={self.feedback!r}, "
                             f"feedback_decay={self.feedback_decay!r}")
        if self.diagnostics and self.integration == "fsdp1":
            raise ValueError("diagnostics read each parameter by name: use integration 'simple' or 'fsdp2' "
                             "(FSDP1 flattens the parameters)")

        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        for field, allowed in (("integration", INTEGRATIONS), ("compression", COMPRESSIONS), ("transport", TRANSPORTS),
                               ("device", DEVICES)):
            if getattr(self, field) not in allowed:
                raise ValueError(f"{field} must be one of {allowed}, got {getattr(self, field)!r}")
        if self.device == "cuda-shared" and (self.integration != "ddp" or self.hosts != 1):
            raise ValueError("device='cuda-shared' (every rank on one GPU, gloo carrying the CUDA tensors) runs "
                             "integration='ddp' on one host only: gloo moves CUDA tensors for all-reduce, all-gather "
                             "and broadcast, which is all DDP and its hooks use; "
                             f"got integration={self.integration!r}, hosts={self.hosts!r}")
        if self.transport == "gloo" and self.compression != "none":
            raise ValueError("transport='gloo' (FSDP's own reduce-scatter) only applies to compression='none'")
        for field in ("steps", "batch_size", "world", "threads", "eval_interval", "eval_tokens"):
            if not isinstance(getattr(self, field), int) or getattr(self, field) < 1:
                raise ValueError(f"{field} must be a positive integer, got {getattr(self, field)!r}")
        if self.warmup_steps < 0 or not 0 < self.lr or not 0 <= self.min_lr <= self.lr:
            raise ValueError("need warmup_steps >= 0 and 0 <= min_lr <= lr, lr > 0")
        if self.param_dtype not in REDUCE_DTYPES:
            raise ValueError(f"param_dtype must be one of {tuple(REDUCE_DTYPES)}, got {self.param_dtype!r}")
        if self.param_dtype and self.integration == "ddp":
            raise ValueError("param_dtype is FSDP's parameter all-gather dtype: DDP gathers no parameters "
                             "(leave it out)")
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype must be one of {tuple(REDUCE_DTYPES)}, got {self.reduce_dtype!r}")
        if self.checkpoint_every < 0 or (self.checkpoint_every and not self.checkpoint_dir):
            raise ValueError(f"checkpoint_every must be >= 0 and needs checkpoint_dir, got {self.checkpoint_every!r}")
        if self.keep_checkpoints < 0:
            raise ValueError(f"keep_checkpoints must be >= 0 (0 keeps every checkpoint), got {self.keep_checkpoints!r}")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume needs checkpoint_dir (where the checkpoints are)")
        for field in ("group_timeout_s", "max_time_s"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise ValueError(f"{field} must be a positive number of seconds, got {value!r}")
        if self.stop_at is not None and not (isinstance(self.stop_at, int) and 0 < self.stop_at <= self.steps):
            raise ValueError(f"stop_at must be a step count in 1..steps ({self.steps}), got {self.stop_at!r}")
        if not isinstance(self.hosts, int) or self.hosts < 1 or self.world % self.hosts:
            raise ValueError(f"hosts must be a positive integer dividing world ({self.world}), got {self.hosts!r}")
        if self.hsdp and (self.integration not in HSDP_INTEGRATIONS or self.hosts < 2):
            raise ValueError("hsdp applies to integration='fsdp2' or 'simple' (SimpleFSDP) on several hosts "
                             f"(hosts >= 2), got integration={self.integration!r}, hosts={self.hosts}")
        if self.integration == "ddp" or self.torch_hook:
            check_ddp_settings(self)
        if self.hosts > 1 and self.link == "scaled":
            raise ValueError("link='scaled' calibrates one host's loopback; give emulated hosts a rate (e.g. 1gbit)")
        if not 0 < self.link_share < 1:
            raise ValueError(f"link_share must be a fraction in (0, 1), got {self.link_share!r}")
        if self.link not in ("none", "scaled"):
            from testbed.link import parse_rate

            parse_rate(self.link)
        arguments = self.hook_arguments()
        if self.feedback != "classic" and (self.torch_hook or arguments is None):  # no hook of ours to check it
            raise ValueError(f"feedback={self.feedback!r} applies to our hook's error-feedback codecs (not to "
                             "--torch-hook, nor to FSDP's own reduce)")
        if arguments is not None and not self.torch_hook:  # the library validates, once, the hook the run builds
            from tagc.hooks.core.settings import HookSettings

            HookSettings.from_arguments(**arguments).make_codecs()

    @property
    def run_name(self) -> str:
        if self.name:
            return self.name
        from tagc.hooks.codecs.registry import spec

        if self.compression == "none":
            algo = "fsdp"
        elif fields := spec(self.codec).config_fields:
            index = f"-b{self.index_bits}" if "index_bits" in fields else ""
            held = f"-s{self.sparsity:g}" if self.sparsity != "auto" else ""
            algo = f"{self.codec}-{self.compression}-r{self.ratio:g}{index}{held}"
        else:
            algo = f"{self.codec}-{self.compression}"
        algo += "".join(f"-{key}{value}" for key, value in sorted(self.codec_options.items()))
        if self.plain != "fp32":
            algo += f"-plain{self.plain}"
        if self.reduce_dtype:
            algo += f"-reduce-{self.reduce_dtype}"
        if self.param_dtype:
            algo += f"-param-{self.param_dtype}"
        if self.compression != "none" and self.dense_steps:
            algo += f"-dense{self.dense_steps}"
        if self.feedback != "classic":
            algo += f"-{self.feedback}"
            algo += f"d{self.feedback_decay:g}" if self.feedback_decay != 1.0 else ""
            algo += "-lr" if self.feedback_decay_follows_lr else ""
        if self.torch_hook:
            algo += "-torch"
        if self.hosts > 1:
            algo += "-hsdp" if self.hsdp else "-flat" if self.hierarchy == "flat" else ""
        return f"{self.integration}{'-compiled' if self.compile else ''}-{algo}{'' if self.overlap else '-no-overlap'}"

    def to_json(self) -> str:
        settings = dataclasses.asdict(self)
        del settings["library_filled"]
        return json.dumps(settings)


def param_gather(cfg: TrainConfig) -> str | None:
    """A run's parameter all-gather dtype as reports give it: ``fp32`` (the parameters' own) or ``bf16``;
    ``None`` under DDP, which gathers no parameters."""
    return None if cfg.integration == "ddp" else cfg.param_dtype or "fp32"


def library_codec_settings(config: TrainConfig) -> dict[str, Any]:
    """The ``ratio``, ``plain``, ``feedback``, ``feedback_decay`` and ``codec_options`` that ``tagc.hook()`` gives
    ``config``'s codec for those it leaves unset (``None``, or an option not named): the codec's recommended
    setting (:func:`tagc.hooks.core.settings.recommended_settings`); a run with ``compression="none"`` or
    ``torch_hook`` runs no codec of ours and takes the neutral ones (fp32, classic, no fading)."""
    from tagc.config import TAGCConfig
    from tagc.hooks.core.settings import recommended_settings

    ours = config.compression != "none" and not config.torch_hook
    filled = recommended_settings(config.codec if ours else "plain", config.ratio, config.plain, config.feedback,
                                  config.feedback_decay, config.codec_options if ours else None, config.index_bits)
    return {"ratio": filled["ratio"] if filled["ratio"] is not None else TAGCConfig().ratio, "plain": filled["plain"],
            "feedback": filled["feedback"], "feedback_decay": filled["feedback_decay"],
            "codec_options": filled["options"] if ours else dict(config.codec_options)}


def library_dense_steps(codec: str, compression: str) -> int:
    """The dense warm-up ``tagc.hook(codec=codec)`` gives when ``dense_steps`` is not passed
    (:data:`tagc.hooks.core.engine.DENSE_STEPS` for a codec with error feedback, else 0); 0 for
    ``compression="none"``, which runs no codec."""
    if compression == "none":
        return 0
    from tagc.config import TAGCConfig
    from tagc.hooks.codecs.registry import make_codec
    from tagc.hooks.core.engine import DENSE_STEPS

    return DENSE_STEPS if make_codec(codec, TAGCConfig()).error_feedback else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gpt2_bench.train", description="Train GPT-2 with sharded data "
                                "parallelism, optionally over an emulated link or emulated hosts.")
    from tagc.hooks.codecs.registry import codec_names
    from tagc.hooks.core.settings import NEUTRAL, PLAIN_CODECS, RECOMMENDED

    def library_default(setting: str) -> str:
        """The library's default of ``setting`` per codec, as help text: "int4 for tagc and topk, else fp32"."""
        codecs = [codec for codec, filled in RECOMMENDED.items() if setting in filled]
        values = {RECOMMENDED[codec][setting] for codec in codecs}
        if len(values) != 1:  # the codecs that set it disagree: name each
            each = ", ".join(f"{RECOMMENDED[codec][setting]} for {codec}" for codec in codecs)
            return f"{each}, else {NEUTRAL[setting]}"
        return f"{values.pop()} for {' and '.join(codecs)}, else {NEUTRAL[setting]}"

    defaults = TrainConfig()  # the codec settings the library fills in (ratio, plain, feedback...) default to None
    p.add_argument("--preset", default=defaults.preset, help="model preset: tiny, small, gpt2, gpt2-untied")
    p.add_argument("--integration", default=defaults.integration, choices=INTEGRATIONS)
    p.add_argument("--compression", default=defaults.compression, choices=COMPRESSIONS,
                   help="which parameters the codec compresses: none, all, non-attn (the paper's non-attention "
                        "linears, the embedding and LM head included), blocks (non-attn less the embedding and LM "
                        "head)")
    p.add_argument("--transport", default=defaults.transport, choices=TRANSPORTS,
                   help="plain exchange for --compression none: fair all-to-all (default) or FSDP's own gloo "
                        "reduce-scatter")
    p.add_argument("--codec", default=defaults.codec,
                   help=f"how the --compression columns cross the wire: {', '.join(codec_names())} (default tagc)")
    p.add_argument("--codec-option", dest="codec_options", action="append", default=[], metavar="NAME=VALUE",
                   help="a codec option, e.g. --codec int4 --codec-option block=128 (repeatable)")
    p.add_argument("--plain", default=None, choices=tuple(PLAIN_CODECS),
                   help="the codec of the columns not compressed (attention, biases, norms, embeddings by "
                        "default); default: the library's, " + library_default("plain"))
    p.add_argument("--param-dtype", default=None, choices=[d for d in REDUCE_DTYPES if d],
                   help="FSDP's parameter all-gather dtype (bf16: MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                        "reduce_dtype=torch.float32); SimpleFSDP on the CPU computes in float32)")
    p.add_argument("--reduce-dtype", default=None, choices=[d for d in REDUCE_DTYPES if d],
                   help="FSDP's own gradient reduce dtype (bf16: MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))")
    p.add_argument("--ratio", type=float, default=None,
                   help="compression ratio of tagc and topk (default: the library's, "
                        + ", ".join(f"{filled['ratio']} for {codec}" for codec, filled in RECOMMENDED.items()) + ")")
    p.add_argument("--index-bits", type=int, default=defaults.index_bits, choices=(1, 4))
    p.add_argument("--sparsity", type=sparsity_arg, default=defaults.sparsity,
                   help="tagc and topk: the share of entries each rank holds back, auto (the density --ratio plans) "
                        "or a fraction such as 0.3 (70%% of entries sent; default %(default)s)")
    for field in ("steps", "batch_size", "block_size", "eval_interval", "eval_tokens", "seed", "world", "threads",
                  "warmup_steps", "min_compress_numel"):
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=getattr(defaults, field))
    p.add_argument("--dense-steps", type=int, default=None,
                   help="steps sent uncompressed before the codec starts (default: the library's, tagc.hook()'s: "
                        "10 for the error-feedback codecs tagc, topk, sign, powersgd; 0 for the others)")
    p.add_argument("--diagnostics", action="store_true",
                   help="log per-step diagnostics of the codec against AdamW (gpt2_bench.diagnostics) to "
                        "<run>.diagnostics.jsonl; compare two runs with python -m gpt2_bench.diagnostics PLAIN RUN")
    p.add_argument("--feedback", default=None, choices=("classic", "ef21"),
                   help="error feedback of the error-feedback codecs (tagc, topk, sign, powersgd): classic (the "
                        "codec's own) or ef21 (tagc.hooks.codecs.feedback); default: the library's, "
                        + library_default("feedback"))
    p.add_argument("--feedback-decay", type=float, default=None, metavar="GAMMA",
                   help="--feedback ef21: every shift fades by GAMMA each step, h = GAMMA h + C(g - GAMMA h), so an "
                        "element that is not sent fades instead of holding its last value (default: the "
                        "library's when it is EF21, " + library_default("feedback_decay") + ": none)")
    p.add_argument("--feedback-decay-follows-lr", action="store_true", default=defaults.feedback_decay_follows_lr,
                   help="call hook.follow_lr(optimizer) as users do: with EF21's fading GAMMA < 1, fade by "
                        "1 - (1 - GAMMA) * lr / peak lr at each step, holding more as the learning rate decays")
    p.add_argument("--device", default=defaults.device, choices=DEVICES,
                   help="cuda: one GPU per rank (LOCAL_RANK), NCCL, bf16 autocast; cuda-shared: every rank on GPU 0 "
                        "over gloo, bf16 autocast (DDP only: quality runs of several ranks on one GPU, not timings); "
                        "cpu: gloo; auto (default): cuda when a GPU is visible")
    p.add_argument("--hosts", type=int, default=defaults.hosts,
                   help="emulated hosts, each a network namespace running --nproc-per-host ranks under torchrun; "
                        "--link shapes the links between hosts (default 1: every rank on one loopback)")
    p.add_argument("--nproc-per-host", type=int, default=None, help="ranks per emulated host (default: world / hosts)")
    p.add_argument("--flat", dest="hierarchy", action="store_const", const="flat", default=defaults.hierarchy,
                   help="exchange every rank with every rank across hosts (default: plain within a host, the codec "
                        "between hosts)")
    p.add_argument("--hsdp", action="store_true",
                   help="fsdp2 or simple: shard within a host, replicate across hosts (a 2-D mesh); the gradient "
                        "crosses hosts as an all-reduce")
    p.add_argument("--torch-hook", action="store_true",
                   help="--integration ddp: run --codec bf16 or powersgd as torch's own DDP comm hook "
                        "(bf16_compress_hook, powerSGD_hook; --codec-option rank=R) instead of through tagc.ddp_hook")
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--group-timeout", dest="group_timeout_s", type=float, default=defaults.group_timeout_s,
                   help="seconds a rank waits on a collective before failing (detects hangs and dead ranks; default "
                        "%(default)s)")
    p.add_argument("--max-time", dest="max_time_s", type=float, default=None,
                   help="stop cleanly after this many seconds of training (checkpointing first with "
                        "--checkpoint-every); default: no limit")
    p.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                   help="stop cleanly after this many steps of the --steps schedule (checkpointing first with "
                        "--checkpoint-every), to be resumed later with --resume; default: run every step")
    p.add_argument("--checkpoint-dir", default=None, help="where sharded checkpoints go (one step-<N> directory each)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="write a checkpoint every N steps (0: never)")
    p.add_argument("--keep-checkpoints", type=int, default=0,
                   help="keep only the newest K complete checkpoints (default 0: keep all); each holds about 12 "
                        "bytes a parameter (weights, AdamW's moments), more with error-feedback residuals")
    p.add_argument("--resume", action="store_true", help="go on from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--fault-step", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="wait for each unit's reduce-scatter in its backward (by default it overlaps the backward of "
                        "the units before it and all finish at the end of backward)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (simple: fullgraph, Inductor)")
    p.add_argument("--link", default=defaults.link, help="none, scaled, or a rate such as 10gbit, 1gbit, 100mbit")
    p.add_argument("--share", dest="link_share", type=float, default=defaults.link_share,
                   help="--link scaled: the plain exchange's share of a non-overlapped plain step on the scaled link "
                        "(default %(default)s, the paper's; 0.9 for an H100-class GPU over 10 GbE)")
    p.add_argument("--dataset", "--corpus", dest="dataset", default=defaults.dataset,
                   help="bbc (offline default), mix (offline, 9.0M tokens: a 2,000-step run reads no token twice), "
                        "a local file, or a prepared folder (holding meta.json: used as it is)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--out-dir", default=defaults.out_dir)
    p.add_argument("--name", default=None)
    # internal: one rank, started by torchrun (gpt2_bench.launch)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--data-dir", help=argparse.SUPPRESS)
    p.add_argument("--log-file", dest="log", help=argparse.SUPPRESS)
    return p


def sparsity_arg(text: str) -> float | str:
    """``--sparsity``'s value: ``"auto"`` or a fraction (:class:`tagc.config.TAGCConfig` checks its range)."""
    return text if text == "auto" else float(text)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields}
    values["codec_options"] = parse_codec_options(args.codec_options)
    if getattr(args, "nproc_per_host", None):
        values["world"] = args.hosts * args.nproc_per_host
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


TORCH_HOOKS = ("bf16", "powersgd")
"""The codecs torch ships as DDP comm hooks (``--torch-hook``): ``bf16_compress_hook``, ``powerSGD_hook``."""


def check_ddp_settings(cfg: TrainConfig) -> None:
    """The settings the DDP layout cannot take, as clear errors (called by :class:`TrainConfig`)."""
    if cfg.torch_hook and cfg.integration != "ddp":
        raise ValueError("torch_hook runs torch's own DDP comm hooks: it needs integration='ddp'")
    if cfg.integration != "ddp":
        return
    if cfg.reduce_dtype:
        raise ValueError("reduce_dtype is FSDP's mixed-precision reduce; under integration='ddp' use torch's bf16 hook "
                         "(--torch-hook --codec bf16 --compression all) or our bf16 codec")
    if cfg.hsdp:
        raise ValueError("hsdp is FSDP2's 2-D mesh: DDP already replicates across hosts (leave out --hsdp)")
    if not cfg.torch_hook:
        return
    if cfg.compression != "all" or cfg.codec not in TORCH_HOOKS:
        raise ValueError(f"torch_hook: torch's DDP hooks reduce every bucket: use compression='all' with codec one of "
                         f"{TORCH_HOOKS}, got compression={cfg.compression!r}, codec={cfg.codec!r}")
    allowed = {"rank"} if cfg.codec == "powersgd" else set()
    extra = set(cfg.codec_options) - allowed
    if extra:
        raise ValueError(f"torch_hook with codec {cfg.codec!r} takes codec options {sorted(allowed) or 'none'}, "
                         f"got {sorted(extra)}")
    if cfg.plain != "fp32":
        raise ValueError("torch_hook: torch's hooks have no plain codec (leave --plain out)")
    if cfg.codec == "powersgd" and (cfg.checkpoint_every or cfg.resume):
        raise ValueError("torch_hook: torch's powerSGD_hook keeps its state (errors, warm-start P and Q) in no "
                         "checkpoint here: run it without --checkpoint-every and --resume")
    if cfg.diagnostics:
        raise ValueError("diagnostics read our codecs' residuals by parameter: not available with torch_hook")
