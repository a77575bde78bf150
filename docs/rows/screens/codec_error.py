"""The twelfth to fourteenth screens (docs/quality-diagnosis.md): what each selection at ``tagc.hook()``'s bytes
adds to the mean of the ranks' gradients (two, or ``--ranks``), in units of that mean's minibatch noise, on real
gradients at fixed weights.

A model of the codecs, not the codecs: selections are exact top-k per parameter (TAGC's peel decoded every
entry in the decision runs), EF21 with shifts fading by 0.9 where a codec has feedback, values rounded as the
wire would. Per step ``t``: ``error = ||estimate - mean||^2`` and ``noise = ||(g_0 - g_1) / 2||^2`` (the
variance of the mean of two draws; of ``N``: ``sum_r ||g_r - mean||^2 / (N (N - 1))``), over the parameters
``tagc.hook()`` compresses; the record is the median of
``error / noise`` over the steps after the first third (EF21's shifts start at zero), and over those same steps the
summed error against the summed noise, ``||sum_t (estimate - mean)||^2 / sum_t noise``: an error that points the
same way step after step (what a fading shift or a stateless rounding's bias leaves out for good) grows in it with
the steps, where a fresh, independent one does not.

    python docs/rows/screens/codec_error.py CHECKPOINT --batch 4 --steps 12 --json OUT.json [--screen density]
    python docs/rows/screens/codec_error.py CHECKPOINT --screen group --ranks 8 --json OUT.json

``--screen group``: ``tagc.hook()`` and ``tagc.hook(codec="topk")`` at the per-rank share they plan for ``--ranks``
(:func:`tagc.sketch.plan_density` at ratio 4.5 and 1.2), beside ``int4``. Step ``s`` reads the same windows for
every split of one global batch (``--ranks 8 --batch 4`` and ``--ranks 2 --batch 16``), so their mean and its
noise are alike and only the split differs.

``CHECKPOINT``: a ``step-N`` directory a decision run left (``python -m gpt2_bench.evidence run ...`` keeps the
last under ``bench_out/evidence/checkpoints``); its windows are seed 7's, a seed no decision judges.
"""
import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from gpt2_bench.data import TokenData, prepare
from gpt2_bench.model import GPT, GPTConfig
from tagc.hooks.core.selection import non_attention_linear
from tagc.sketch import plan_density

FADING = 0.9
BLOCK = 64
SEED = 7


def top(scores: torch.Tensor, share: float) -> torch.Tensor:
    k = max(1, int(share * scores.numel()))
    return scores >= scores.kthvalue(scores.numel() - k + 1).values


def per_block(values: torch.Tensor, block: int) -> torch.Tensor:
    return F.pad(values, (0, -values.numel() % block)).view(-1, block)


def rounded(values: torch.Tensor, dtype: torch.dtype, top_value: float, power_of_two: bool) -> torch.Tensor:
    blocks = per_block(values, 1024)
    scale = blocks.abs().amax(1, keepdim=True).clamp_min(1e-30) / top_value
    scale = torch.exp2(torch.ceil(torch.log2(scale))) if power_of_two else scale
    return (blocks / scale).to(dtype).float().mul(scale).flatten()[: values.numel()]


def fp8(values):
    return rounded(values, torch.float8_e4m3fn, 448.0, True)


def fp16(values):
    return rounded(values, torch.float16, 60000.0, False)


def int4(values: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    blocks = per_block(values, 128)
    scale = blocks.abs().amax(1, keepdim=True).clamp_min(1e-30) / 7
    codes = torch.floor(blocks / scale + torch.rand(blocks.shape, generator=generator)).clamp(-7, 7)
    return (codes * scale).flatten()[: values.numel()]


def masks(kind: str, changes: list[torch.Tensor], share: float) -> list[torch.Tensor]:
    if kind == "own":  # each rank its own largest entries (tagc, topk)
        return [top(c.abs(), share) for c in changes]
    if kind == "blocks":  # one support for every rank: blocks by their summed energy (ARC-Top-K's idea)
        energy = sum(per_block(c, BLOCK).pow(2).sum(1) for c in changes)
        return [top(energy, share).repeat_interleave(BLOCK)[: changes[0].numel()]] * len(changes)
    return [top(sum(c.abs() for c in changes), share)] * len(changes)  # shared entries, an oracle


SCREENS = {  # name: (mask kind, kept share, value rounding)
    "support": {  # the twelfth screen: a support the ranks share, at about 4 bits per compressed element
        "tagc: own top 8.1%, exact": ("own", 0.081, None),
        "topk-f8: own top 35%, float8": ("own", 0.35, fp8),
        "shared blocks of 64, 23%, float16": ("blocks", 0.23, fp16),
        "shared blocks of 64, 46%, float8": ("blocks", 0.46, fp8),
        "shared entries, 23%, float16 (oracle)": ("entries", 0.23, fp16),
        "int4, no feedback": ("int4", None, None),
    },
    "density": {  # the thirteenth: denser selections, at 2 to 3 times the bytes (TAGC: ratio 2.25 and 1.5)
        "tagc: own top 8.1%, exact (ratio 4.5, 4.6 bits)": ("own", 0.081, None),
        "tagc: own top 17%, exact (ratio 2.25, 8.1 bits)": ("own", 0.170, None),
        "tagc: own top 27%, exact (ratio 1.5, 11.7 bits)": ("own", 0.270, None),
        "topk-f8: own top 35%, float8 (about 4 bits)": ("own", 0.35, fp8),
        "topk-f8: own top 70%, float8 (about 7.4 bits)": ("own", 0.70, fp8),
        "int4, no feedback (4.25 bits)": ("int4", None, None),
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--batch", type=int, default=4, help="windows of 128 tokens per rank (4: 1x, 16: 4x)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--json", required=True)
    parser.add_argument("--screen", choices=sorted(SCREENS) + ["group"], default="support",
                        help="which selections: the twelfth screen's (support, the default), the thirteenth's, or "
                             "the sparse codecs at the share they plan for --ranks (group)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks whose gradients are averaged")
    args = parser.parse_args()
    ranks = args.ranks
    tagc, topk = plan_density(4.5, ranks), plan_density(1.2, ranks)
    selections = SCREENS.get(args.screen) or {f"tagc: own top {tagc:.2%}, exact (ratio 4.5)": ("own", tagc, None),
                                              f"topk-f8: own top {topk:.2%}, float8 (ratio 1.2)": ("own", topk, fp8),
                                              "int4, no feedback": ("int4", None, None)}
    torch.set_num_threads(1)
    checkpoint = Path(args.checkpoint)
    saved = checkpoint.with_suffix(".pt")
    if not saved.exists():
        dcp_to_torch_save(checkpoint, saved)
    model = GPT(GPTConfig.preset("small", block_size=128))
    model.load_state_dict({k.removeprefix("module."): v for k, v in torch.load(saved)["model"].items()})
    modules = dict(model.named_modules())
    params = [p for n, p in model.named_parameters() if non_attention_linear(n, modules.get(n.rsplit(".", 1)[0]))]
    data = TokenData(prepare("mix", progress=False))
    start = int(checkpoint.name.rsplit("-", 1)[1])
    shifts = {name: [[torch.zeros(p.numel()) for p in params] for _ in range(ranks)] for name in selections}
    generator = torch.Generator().manual_seed(0)
    ratios = {name: [] for name in selections}
    settled = start + args.steps // 3
    summed = {name: [torch.zeros(p.numel()) for p in params] for name in selections}
    summed_noise = 0.0

    def gradients(step: int, rank: int) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        x, y = data.train_batch(step, args.batch, 128, SEED, "cpu", rank, ranks)
        model(x, y)[1].backward()
        return [p.grad.flatten().clone() for p in params]

    for step in range(start, start + args.steps):
        per_param = list(zip(*(gradients(step, rank) for rank in range(ranks))))  # each parameter: one per rank
        means = [sum(per_rank) / ranks for per_rank in per_param]
        noise = sum(sum((g - mean).pow(2).sum() for g in per_rank) for per_rank, mean in zip(per_param, means)).item()
        noise /= ranks * (ranks - 1)
        summed_noise += noise if step >= settled else 0.0
        for name, (kind, share, rounding) in selections.items():
            error = 0.0
            for j, per_rank in enumerate(per_param):
                if kind == "int4":
                    estimate = sum(int4(g, generator) for g in per_rank) / ranks
                else:
                    h = shifts[name]
                    changes = [per_rank[r] - FADING * h[r][j] for r in range(ranks)]
                    for r, mask in enumerate(masks(kind, changes, share)):
                        sent = torch.where(mask, changes[r], 0.0)
                        h[r][j] = FADING * h[r][j] + (torch.where(mask, rounding(sent), 0.0) if rounding else sent)
                    estimate = sum(h[r][j] for r in range(ranks)) / ranks
                off = estimate - means[j]
                error += off.pow(2).sum().item()
                if step >= settled:
                    summed[name][j] += off
            ratios[name].append(error / noise)
        print(step, " ".join(f"{r[-1]:.3f}" for r in ratios.values()), flush=True)
    kept = slice(settled - start, None)
    record = {"checkpoint": checkpoint.name, "batch": args.batch, "steps": args.steps, "seed": SEED,
              "screen": args.screen, "ranks": ranks,
              "median_error_over_noise": {name: sorted(r[kept])[len(r[kept]) // 2] for name, r in ratios.items()},
              "summed_error_over_summed_noise": {name: sum(e.pow(2).sum().item() for e in summed[name]) / summed_noise
                                                 for name in selections},
              "per_step": ratios}
    Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "per_step"}, indent=1))


if __name__ == "__main__":
    main()
