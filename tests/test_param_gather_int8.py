"""SimpleFSDP's int8 blockwise parameter all-gather (ZeRO++'s qwZ, ``MixedPrecisionPolicy(param_gather="int8")``):
every gathered element within half its block's scale of the exact one (random and adversarial chunks, odd sizes,
tiny shards), the sharded master weights exact, its bytes the int8 codes plus the float32 scales, and 2-rank gloo
training steps, eager and compiled, close to the fp32 gather's."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn

from fsdp_integration import MixedPrecisionPolicy, quantized_gather, simple_fsdp, units
from fsdp_integration.simple_fsdp import param_gather_bytes
from gpt2_bench.config import TrainConfig
from gpt2_bench.model import GPT, GPTConfig
from tests.distributed import run_ranks

ROUNDING = 1e-5
"""float32 rounding on top of the half scale: ``x / scale`` (|.| <= 127), the scale itself and ``code * scale``,
each within 2^-24 relative, add up to under 3 * 127 * 2^-24 < 2.3e-5 / 2 of a scale."""


def _bounds(chunk: torch.Tensor, block: int) -> torch.Tensor:
    """Per element, half its block's ``absmax / 127`` (plus float32 rounding), computed block by block."""
    values = chunk.double().reshape(-1)
    bound = torch.empty_like(values)
    for start in range(0, values.numel(), block):
        scale = values[start : start + block].abs().max() / 127
        bound[start : start + block] = scale * (0.5 + ROUNDING)
    return bound


def _chunks() -> dict[str, tuple[torch.Tensor, int]]:
    gen = torch.Generator().manual_seed(0)
    normal = lambda n: torch.randn(n, generator=gen)  # noqa: E731
    huge = normal(700)
    huge[300] = 1e6  # one huge element: its block's others round to 0 (within half its scale), the rest unharmed
    mixed = normal(1024) * torch.logspace(-6, 3, 1024)  # magnitudes over 9 decades
    zeros = normal(768)
    zeros[256:512] = 0  # a block of zeros comes back exactly
    return {"random": (normal(4096), 256), "odd size": (normal(1000), 256), "below one block": (normal(37), 256),
            "one element": (normal(1), 256), "huge element": (huge, 256), "mixed magnitudes": (mixed, 256),
            "zeros block": (zeros, 256), "all zeros": (torch.zeros(300), 256), "small blocks": (normal(1001), 7),
            "bf16 chunk": (normal(513).to(torch.bfloat16), 256)}


@pytest.mark.parametrize("name", list(_chunks()))
def test_one_chunk_comes_back_within_half_a_block_scale(name):
    chunk, block = _chunks()[name]
    wire = quantized_gather.quantize(chunk, block)
    blocks = -(-chunk.numel() // block)
    assert wire.dtype == torch.int8 and wire.numel() == quantized_gather.wire_numel(chunk.numel(), block)
    assert wire.numel() == blocks * block + 4 * blocks  # int8 codes, a float32 scale per block
    back = quantized_gather.dequantize(wire, 1, chunk.numel(), block, torch.float32)
    error = (back.double() - chunk.double()).abs()
    assert back.shape == chunk.shape and torch.all(error <= _bounds(chunk, block))
    assert torch.equal(back[chunk == 0], torch.zeros_like(back[chunk == 0]))  # zeros stay exact
    if name == "random":  # the bound is nearly reached (round to nearest, not something tighter or looser)
        assert (error / _bounds(chunk, block)).max() > 0.9
    if name == "huge element":  # the block's absmax is code 127: back but for float32 rounding of the scale
        assert abs(back[300].item() - 1e6) <= 1e6 * 2**-22


def test_every_ranks_wire_dequantizes_to_its_own_chunk():
    gen = torch.Generator().manual_seed(1)
    chunks = [torch.randn(515, generator=gen) * (10.0**rank) for rank in range(3)]
    gathered = torch.cat([quantized_gather.quantize(chunk, 64) for chunk in chunks])
    back = quantized_gather.dequantize(gathered, 3, 515, 64, torch.float32).view(3, 515)
    for rank, chunk in enumerate(chunks):
        assert torch.all((back[rank].double() - chunk.double()).abs() <= _bounds(chunk, 64))


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match=r"param_gather must be one of \(None, 'int8'\)"):
        MixedPrecisionPolicy(param_gather="int4")
    with pytest.raises(ValueError, match="gather_block must be a positive integer"):
        MixedPrecisionPolicy(param_gather="int8", gather_block=0)
    with pytest.raises(ValueError, match="integration='simple'"):
        TrainConfig(integration="fsdp2", param_dtype="int8")
    with pytest.raises(ValueError, match="DDP gathers no parameters"):
        TrainConfig(integration="ddp", compression="none", param_dtype="int8")
    assert "-param-int8" in TrainConfig(param_dtype="int8").run_name


# ----------------------------------------------------------------------------- on 2 gloo ranks


class _Small(nn.Module):
    """Odd shapes: a 1-row bias (rank 1 holds none of it), 5 columns, a norm; one huge weight, one zero matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(5, 3), nn.Linear(3, 1), nn.LayerNorm(7)])
        self.head = nn.Linear(4, 4)
        with torch.no_grad():
            self.layers[0].weight[1, 2] = 1e4
            self.head.weight.zero_()


def _gathered_within_bound(rank, world, block, hosts):
    torch.manual_seed(0)
    model = _Small()
    exact = {name: p.detach().clone() for name, p in model.named_parameters()}
    mesh = None
    if hosts > 1:  # HSDP: gathered within a host (2 ranks), replicated across hosts
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (hosts, world // hosts), mesh_dim_names=("replicate", "shard"))
    model = simple_fsdp(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_gather="int8", gather_block=block))
    within, masters, wires = [], [], []
    for unit in units(model):
        bucket, shards = unit.bucket, unit.local_shards()
        rank = bucket.rank  # within the group the unit is gathered over
        gathered = bucket.gather_detached(shards)
        chunk_bounds = _bounds(bucket.pack_shards(shards, torch.float32), block)  # of this rank's own blocks
        bounds = bucket.unpack_shards(chunk_bounds, [torch.float64] * len(shards))
        for entry, full, shard, bound in zip(bucket.entries, gathered, shards, bounds):
            rows = slice(rank * entry.rows, rank * entry.rows + entry.local_rows)  # this rank's rows, its own blocks
            error = (full[rows].double() - exact[entry.fqn][rows].double()).abs()
            within.append((entry.fqn, bool(torch.all(error <= bound)), full.shape == exact[entry.fqn].shape))
            masters.append(torch.equal(shard, exact[entry.fqn][rows]))  # the sharded fp32 weights stay exact
        wire = bucket.gather_wire(shards)
        wires.append((wire.dtype, wire.numel(), bucket.gather_input_bytes(torch.float32), bucket.chunk,
                      unit.reshard))
    huge = model.layers[0].weight  # touched outside forward: gathered, quantized
    return {"within": within, "masters": masters, "wires": wires, "bytes": param_gather_bytes(model),
            "huge": huge[1, 2].item(), "zeros": model.head.weight.abs().max().item()}


@pytest.mark.parametrize("block, hosts", [(4, 1), (256, 1), pytest.param(256, 2, marks=pytest.mark.slow)],
                         ids=["block-4", "block-256", "hsdp-2x2"])
def test_gathered_parameters_are_within_the_bound_and_the_masters_stay_exact(block, hosts):
    for result in run_ranks(_gathered_within_bound, 2 * hosts, block, hosts, timeout_s=120):
        assert result["within"] and all(ok and same_shape for _, ok, same_shape in result["within"]), result["within"]
        assert all(result["masters"])
        expected = 0
        for dtype, numel, counted, chunk, reshard in result["wires"]:
            blocks = -(-chunk // block)
            assert dtype == torch.int8 and numel == counted == blocks * block + 4 * blocks  # codes + fp32 scales
            expected += (2 if reshard else 1) * (2 - 1) * numel
        assert result["bytes"] == expected
        assert abs(result["huge"] - 1e4) <= 1e4 * 2**-22 and result["zeros"] == 0.0


def _models(seed: int):
    torch.manual_seed(seed)
    config = GPTConfig.preset("tiny", vocab_size=101, n_embd=64)
    first, second = GPT(config), GPT(config)
    second.load_state_dict(first.state_dict())
    return first, second


def _train(rank, world, compiled, hooked, gathers=("fp32", "int8")):
    """Three AdamW steps of the same model with fp32 and with int8 parameter gathers (``gathers``)."""
    import tagc

    fp32, int8 = _models(0)
    fp32 = simple_fsdp(fp32)
    int8 = simple_fsdp(int8, mp_policy=MixedPrecisionPolicy(param_gather="int8"))
    results = {}
    for name, model in (("fp32", fp32), ("int8", int8)):
        if name not in gathers:
            continue
        if hooked:
            tagc.register_comm_hook(model, tagc.hook(codec="int4", dense_steps=0, min_compress_numel=1024))
        if compiled:
            from fsdp_integration import CompileSettings, compile_model

            step = compile_model(model, CompileSettings(backend=compiled))
        else:
            step = model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(3):
            idx = torch.randint(0, 101, (2 * world, 16), generator=gen)
            tgt = torch.randint(0, 101, (2 * world, 16), generator=gen)
            loss = step(idx[2 * rank : 2 * rank + 2], tgt[2 * rank : 2 * rank + 2])[1]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        results[name] = {"losses": torch.stack(losses),
                         "params": [p.to_local().detach().clone() for p in model.parameters()],
                         "dtypes": {p.dtype for p in model.parameters()}}
    return results


def _check_training(results):
    for result in results:
        fp32, int8 = result["fp32"], result["int8"]
        assert int8["dtypes"] == {torch.float32}  # the master weights the optimizer steps are fp32
        relative = ((int8["losses"] - fp32["losses"]).abs() / fp32["losses"]).max().item()
        assert 0 < relative < 1e-3, relative  # close to the fp32 gathers' loss, and not the same computation
        drift = max((a - b).abs().max().item() for a, b in zip(int8["params"], fp32["params"]))
        assert drift < 1e-2  # three AdamW steps of lr 1e-3 on nearly the same gradients: nearly the same weights


@pytest.mark.parametrize("hooked", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["plain", "int4-hook"])
def test_training_steps_with_int8_gathers_stay_close_to_fp32_gathers(hooked):
    _check_training(run_ranks(_train, 2, None, hooked, timeout_s=180))


def _compiled_as_eager(backend: str, atol: float) -> None:
    """The int8 gathers compiled (fullgraph: traced, not broken out) train as they do eager: the same losses, and
    weights within ``atol`` of eager's."""
    eager = run_ranks(_train, 2, None, False, timeout_s=300)
    compiled = run_ranks(_train, 2, backend, False, ("int8",), timeout_s=600)
    _check_training([{"fp32": a["fp32"], "int8": b["int8"]} for a, b in zip(eager, compiled)])
    for a, b in zip(eager, compiled):
        assert torch.allclose(a["int8"]["losses"], b["int8"]["losses"], rtol=1e-5, atol=0)
        apart = max((x - y).abs().max().item() for x, y in zip(a["int8"]["params"], b["int8"]["params"]))
        assert apart <= atol, apart


@pytest.mark.slow
def test_compiled_int8_gathers_train_as_eager_does():
    _compiled_as_eager("aot_eager", atol=0.0)  # the same kernels as eager: the same weights


@pytest.mark.slow
def test_inductor_compiled_int8_gathers_train_as_eager_does():
    # Inductor's fused kernels round differently, and a weight that moves by a rounding error may flip its code; the
    # weights stay within one AdamW step (lr = 1e-3) of eager's
    _compiled_as_eager("inductor", atol=1e-3)


@pytest.mark.slow  # an Inductor compile: ~8 s
def test_inductor_compiles_the_round_trip_of_several_ranks_wires():
    """The gathered wire of 2 ranks, dequantized by Inductor: the same values as eager (a view of the int8 wire
    as float32 scales, which Inductor miscompiles, would fail here)."""
    gen = torch.Generator().manual_seed(2)
    chunks = [torch.randn(1000, generator=gen), torch.randn(1000, generator=gen) * 3]

    def round_trip(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        wire = torch.cat([quantized_gather.quantize(first, 256), quantized_gather.quantize(second, 256)])
        return quantized_gather.dequantize(wire, 2, 1000, 256, torch.float32)

    eager = round_trip(*chunks)
    assert torch.equal(torch.compile(round_trip, backend="inductor", fullgraph=True)(*chunks), eager)
    assert torch.all((eager.view(2, 1000).double() - torch.stack(chunks).double()).abs()
                     <= torch.stack([_bounds(chunk, 256) for chunk in chunks]))


def test_scales_travel_as_their_own_bytes():
    special = torch.tensor([0.0, 1e-40, 1.5, 3.4e38, float("inf"), float("nan")])  # a subnormal, the largest
    wire = quantized_gather._scale_bytes(special)
    back = quantized_gather._scales_from_bytes(wire.view(-1, 4))
    assert torch.equal(back.view(torch.int32), special.view(torch.int32))  # bit for bit
    if sys.byteorder == "little":
        assert torch.equal(wire, special.view(torch.int8))  # the float32 bytes as they lie in memory


# ----------------------------------------------------------------------------- the trainer's --param-dtype int8


def _sharded_policies(rank, world):
    from gpt2_bench.sharding import shard

    found = {}
    for param_dtype in (None, "bf16", "int8"):
        _, model = _models(0)
        cfg = TrainConfig(preset="tiny", compression="none", transport="gloo", param_dtype=param_dtype)
        model, _ = shard(model, cfg, world)
        bucket = units(model)[0].bucket
        found[param_dtype] = (bucket.param_gather, bucket.param_dtype, bucket.compute_dtype, bucket.reduce_dtype)
    return found


@pytest.mark.slow  # a torchrun launch
def test_the_trainer_flag_picks_simple_fsdps_int8_gather():
    from gpt2_bench.config import build_parser, config_from_args

    assert config_from_args(build_parser().parse_args(["--param-dtype", "int8"])).param_dtype == "int8"
    found = run_ranks(_sharded_policies, 2, timeout_s=120)[0]
    assert found[None] == (None, None, None, None)
    assert found["bf16"] == (None, torch.bfloat16, torch.float32, torch.float32)  # torchtitan's, computed in fp32
    assert found["int8"] == ("int8", None, None, None)  # dequantized to the fp32 parameters' dtype, reduced in fp32


@pytest.mark.slow
def test_a_tiny_training_run_with_int8_gathers_stays_close_to_fp32_gathers(tmp_path):
    import json
    import math

    from gpt2_bench.launch import run
    from tests.test_gpt2_train import bbc_ready

    if not bbc_ready():
        pytest.skip("offline assets missing")
    losses = {}
    for param_dtype in (None, "int8"):
        cfg = TrainConfig(preset="tiny", compression="none", steps=4, block_size=32, warmup_steps=0, eval_interval=4,
                          eval_tokens=256, param_dtype=param_dtype, out_dir=str(tmp_path), group_timeout_s=300)
        result = run(cfg)
        assert math.isfinite(result["val_loss"])
        log = (tmp_path / f"{cfg.run_name}.jsonl").read_text().splitlines()
        losses[param_dtype] = [json.loads(line)["loss"] for line in log if '"step"' in line]
    assert all(0 < abs(a - b) / b < 1e-2 for a, b in zip(losses["int8"], losses[None])), losses
