"""How hard AdamW pushes each kind of weight, read from training checkpoints.

AdamW moves every element by ``lr * u`` with ``u = m_hat / (sqrt(v_hat) + eps)``: close to 1 in size
where the gradient an element sees keeps one sign and size for many steps, small where it is mostly
noise. A codec that hands the optimizer a value held for many steps (EF21's shifts, :mod:`tagc.hooks.codecs.feedback`)
shows as a larger ``u`` than plain training's on the compressed weights, and as many more elements near
full size. This reads ``exp_avg`` and ``exp_avg_sq`` from the trainer's DCP checkpoints
(``--checkpoint-dir``, ``step-N``) and, per kind of weight (the name with the block index as ``*``, e.g.
``transformer.h.*.mlp.c_fc.weight``), prints the RMS of ``u`` and the share of elements with ``|u| > 0.5``,
each checkpoint beside the first (plain training's)::

    python -m gpt2_bench.adam_state PLAIN/step-600 CODEC/step-600 [...]
"""

from __future__ import annotations

import argparse
import dataclasses
import warnings
from collections import defaultdict
from collections.abc import Mapping, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

PREFIX = "optim.state."
"""Where the trainer's checkpoints keep the optimizer state (``optim.state.<param>.exp_avg`` and so on)."""
LARGE = 0.5
"""``|u|`` above this counts as near a full-size step."""


@dataclasses.dataclass(frozen=True)
class Push:
    """AdamW's normalised update ``u`` over one kind of weight."""

    rms: float
    large: float
    """Share of elements with ``|u| >`` :data:`LARGE`."""
    numel: int


def kind(param: str) -> str:
    """``transformer.h.3.mlp.c_fc.weight`` -> ``transformer.h.*.mlp.c_fc.weight``: the weights every block has alike
    (any all-digit name, a block's index, becomes ``*``)."""
    return ".".join("*" if part.isdigit() else part for part in param.split("."))


def load_moments(path: str) -> dict[str, torch.Tensor]:
    """The ``step``, ``exp_avg`` and ``exp_avg_sq`` entries of a DCP checkpoint directory, on the CPU."""
    try:
        entries = FileSystemReader(path).read_metadata().state_dict_metadata
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is not a DCP checkpoint (no .metadata): pass a step-N directory of the "
                                "trainer's --checkpoint-dir") from None
    wanted = {name: torch.empty(meta.size, dtype=meta.properties.dtype) for name, meta in entries.items()
              if name.startswith(PREFIX) and name.endswith((".step", ".exp_avg", ".exp_avg_sq"))}
    if not wanted:
        raise ValueError(f"{path} holds no AdamW state ({PREFIX}<param>.exp_avg ...)")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(wanted, checkpoint_id=path, no_dist=True)
    return wanted


def pushes(moments: Mapping[str, torch.Tensor], betas: tuple[float, float] = (0.9, 0.999),
           eps: float = 1e-8) -> dict[str, Push]:
    """Per kind of weight, the RMS of ``u = m_hat / (sqrt(v_hat) + eps)`` and its share above :data:`LARGE`
    (bias-corrected with each parameter's own step, as AdamW does)."""
    squares, large, counts = defaultdict(float), defaultdict(int), defaultdict(int)
    for name, exp_avg in moments.items():
        if not name.endswith(".exp_avg"):
            continue
        param = name[len(PREFIX) : -len(".exp_avg")]
        step = float(moments[f"{PREFIX}{param}.step"])
        m_hat = exp_avg.double() / (1 - betas[0] ** step)
        v_hat = moments[f"{PREFIX}{param}.exp_avg_sq"].double() / (1 - betas[1] ** step)
        u = m_hat / (v_hat.sqrt() + eps)
        group = kind(param)
        squares[group] += float(u.square().sum())
        large[group] += int((u.abs() > LARGE).sum())
        counts[group] += u.numel()
    return {k: Push((squares[k] / counts[k]) ** 0.5, large[k] / counts[k], counts[k]) for k in sorted(counts)}


def report(paths: Sequence[str], betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> str:
    """A table per kind of weight: each checkpoint's RMS of ``u`` (and its ratio to the first's) and share of
    large ``u``."""
    rows = [pushes(load_moments(path), betas, eps) for path in paths]
    lines = [f"{'weight':<36} {'checkpoint':<48} {'rms u':>7} {'vs first':>8} {'|u|>' + str(LARGE):>8}"]
    for name in rows[0]:
        for path, row in zip(paths, rows):
            if name in row:
                push = row[name]
                ratio = push.rms / rows[0][name].rms if rows[0][name].rms else float("nan")
                lines.append(f"{name:<36} {path[-48:]:<48} {push.rms:7.3f} {ratio:7.2f}x {100 * push.large:7.1f}%")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+", help="step-N directories of the trainer's --checkpoint-dir; the "
                                                       "first is the reference (plain training)")
    parser.add_argument("--betas", default="0.9,0.999", help="AdamW's betas (the trainer's: torch's defaults)")
    parser.add_argument("--eps", type=float, default=1e-8)
    args = parser.parse_args(argv)
    try:
        betas = tuple(float(b) for b in args.betas.split(","))
    except ValueError:
        betas = ()
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        parser.error(f"--betas takes two numbers in [0, 1), e.g. 0.9,0.999; got {args.betas!r}")
    try:
        print(report(args.checkpoints, betas, args.eps))
    except (FileNotFoundError, ValueError) as error:
        parser.error(str(error))


if __name__ == "__main__":
    main()
