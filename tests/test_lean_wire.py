"""The lean wire: coded positions and bf16 values for ``tagc`` and ``topk``, hybrid plain columns."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist

import tagc
from tagc.config import TAGCConfig
from tagc.hooks.codecs.registry import make_codec
from tagc.hooks.core.engine import Segment
from tagc.hooks.core.stats import ExchangeStats
from tagc.sketch.sparsify import capacity, keep_limit
from tests.distributed import eager_and_traced_step, run_ranks
from tests.paper_wire import paper

KEY = "bucket/part"
LEAN = {"positions": "coded", "value_dtype": torch.bfloat16}
DEFAULT_CONFIG = TAGCConfig()  # frozen: one shared default is safe


def exchange(
    name: str, options: dict, grads: list[torch.Tensor], config: TAGCConfig = DEFAULT_CONFIG, steps: int = 1
):
    """Every rank's codec encodes its rows; each owner decodes what it receives (no process group).

    Returns ``(outputs [world][numel] per step, sent [world][numel] per step, codecs, stats per owner)``.
    """
    world, numel = grads[0].shape[-2:]
    codecs = [make_codec(name, config, options=options) for _ in range(world)]
    outputs, sent, stats = [], [], [ExchangeStats() for _ in range(world)]
    for step in range(steps):
        before = [c.residuals.get(KEY, torch.zeros(world, numel)).clone() for c in codecs]
        wires = [codec.encode(grad[step] if grad.dim() == 3 else grad, KEY, None) for codec, grad in zip(codecs, grads)]
        outs, sents = [], []
        for owner in range(world):
            received = [torch.stack([w[i][owner] for w in wires]) for i in range(len(wires[0]))]
            outs.append(codecs[owner].decode(received, numel, KEY, None, stats[owner]))
            grad_rows = [(g[step] if g.dim() == 3 else g)[owner] for g in grads]
            sents.append(sum(before[r][owner] + grad_rows[r] - codecs[r].residuals[KEY][owner] for r in range(world)))
        outputs.append(outs)
        sent.append(sents)
    return outputs, sent, codecs, stats


def wire_bits_per_element(
    name: str, options: dict, numel: int, world: int, config: TAGCConfig = DEFAULT_CONFIG
) -> float:
    codec = make_codec(name, config, options=options)
    return sum(w.row_bytes for w in codec.wire(numel, world, torch.float32)) * 8 / numel


# ----------------------------------------------------------------------------- bytes


@pytest.mark.parametrize("world", [2, 4, 8])
def test_lean_options_cut_the_wire_as_documented(world):
    numel = 1 << 20
    density = TAGCConfig().density(world)
    tagc_bitmap = wire_bits_per_element("tagc", {}, numel, world)
    tagc_lean = wire_bits_per_element("tagc", LEAN, numel, world)
    topk_offsets = wire_bits_per_element("topk", {}, numel, world)
    topk_lean = wire_bits_per_element("topk", LEAN, numel, world)
    assert tagc_bitmap == pytest.approx(1 + 32 / 10, rel=1e-3)
    index_bits = tagc_lean - 16 / 10
    assert index_bits < 0.3 and index_bits < density * (
        math.log2(1 / density) + 3
    )  # ~d (log2(1/d) + 2) + slack; the bitmap's is 1
    assert topk_lean < 0.55 * topk_offsets  # 16-bit offsets + fp32 -> ~7-bit codes + bf16
    # topk's lean list: a bf16 value and an Elias-Fano code (~log2(1/d) + 2 bits) per entry of its capacity
    cap = capacity(numel, density) / numel
    assert cap * (16 + math.log2(1 / density)) <= topk_lean <= cap * (16 + math.log2(1 / density) + 3)
    if world == 2:
        assert topk_lean * (world - 1) / world <= 0.45  # the target at N = 2


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("world, value_dtype", [(2, torch.bfloat16), (3, torch.bfloat16), (5, torch.bfloat16),
                                                (2, "float16"), (3, "float16"), (2, "float8"), (3, "float8")])
def test_topk_lean_sends_exact_bf16_values_and_feeds_their_rounding_back(world, value_dtype):
    """bf16 values, or float16/float8 scaled per block: what every rank sent, exactly (the rounding, even
    float8's 2**-4 of a value, goes back into the residual)."""
    gen = torch.Generator().manual_seed(world)
    numel = 150_000
    grads = [
        torch.randn(3, world, numel, generator=gen) * torch.exp(torch.randn(world, numel, generator=gen))
        for _ in range(world)
    ]
    options = {**LEAN, "value_dtype": value_dtype}
    wire_dtypes = [w.dtype for w in make_codec("topk", TAGCConfig(), options=options).wire(numel, world, torch.float32)]
    stored = {"float16": torch.float16, "float8": torch.uint8}.get(value_dtype, torch.bfloat16)
    assert stored in wire_dtypes
    outputs, sent, codecs, stats = exchange("topk", options, grads, steps=3)
    for step in range(3):
        for owner in range(world):
            out, want = outputs[step][owner], sent[step][owner]
            # every rank sent bf16 values (error feedback kept the rounding); the owner sums them in fp32
            torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    for codec in codecs:
        assert codec.residuals[KEY].isfinite().all()


@pytest.mark.parametrize("world", [2, 4])
def test_tagc_coded_positions_decode_exactly_like_the_bitmap(world):
    gen = torch.Generator().manual_seed(10 + world)
    numel = 200_000
    grads = [torch.randn(world, numel, generator=gen) for _ in range(world)]
    coded, _, _, coded_stats = exchange("tagc", {"positions": "coded"}, [g.clone() for g in grads])
    bitmap, sent, _, _ = exchange("tagc", {}, [g.clone() for g in grads])
    for owner in range(world):
        assert torch.equal(coded[0][owner], bitmap[0][owner])
        want = sent[0][owner]  # peeling subtracts in float32: exact up to its rounding
        torch.testing.assert_close(coded[0][owner], want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
        assert int(coded_stats[owner].unpeeled) == 0 and int(coded_stats[owner].overflow) == 0


def test_tagc_bf16_cells_keep_the_support_and_stay_within_the_stated_bound():
    world, numel = 2, 200_000
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(world, numel, generator=gen) * torch.exp(2 * torch.randn(world, numel, generator=gen))
             for _ in range(world)]
    outputs, sent, codecs, stats = exchange("tagc", {"value_dtype": torch.bfloat16}, grads)
    for owner in range(world):
        out, want = outputs[0][owner], sent[0][owner]
        assert torch.equal(out != 0, want != 0)  # the support is exact
        # the documented bound: a few bf16 roundings (2**-9) of the largest cell
        largest_cell = max(g.abs().max().item() for g in grads) * 3
        assert (out - want).abs().max().item() <= 8 * 2**-9 * largest_cell
        assert ((out - want).norm() / want.norm()).item() < 0.01


def test_tagc_scaled_float16_cells_are_far_closer_than_bf16():
    """float16 cells with a power-of-two scale per 1024: 11 significant bits instead of 8. float8 cells, 4
    significant bits: nothing lands outside the support, and peeling compounds the cells' roundings (2**-4
    of each cell) into a few percent of each value; an entry peeled as the difference of two cells that
    rounded alike comes out 0 (here 27 of 13,912)."""
    world, numel = 2, 200_000
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(world, numel, generator=gen) * torch.exp(2 * torch.randn(world, numel, generator=gen))
             for _ in range(world)]
    errors = {}
    for dtype in ("bfloat16", "float16", "float8"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outputs, sent, _, _ = exchange("tagc", {"value_dtype": dtype}, [g.clone() for g in grads])
        assert any("Prefer value_dtype='float16'" in str(w.message) for w in caught) == (dtype == "float8")
        out, want = outputs[0][0], sent[0][0]
        if dtype == "float8":
            assert not ((out != 0) & (want == 0)).any() and ((out == 0) & (want != 0)).sum() < 0.005 * (want != 0).sum()
            relative = ((out - want).abs() / want.abs())[want != 0]
            assert 2**-6 < relative.median() < 2**-4
        else:
            assert torch.equal(out != 0, want != 0)
        errors[dtype] = ((out - want).norm() / want.norm()).item()
    assert errors["float16"] < errors["bfloat16"] / 8 and errors["float16"] < 1e-3, errors
    assert errors["bfloat16"] * 4 < errors["float8"] < 0.15, errors


SCALED_ROUNDING = {torch.float16: (11, 24), torch.float8_e4m3fn: (4, 17)}
"""Scaled value dtype -> ``(s, f)``: a value comes back within ``2**-s`` of itself (half an ulp of its
significant bits), or ``2**-f`` of its block's absmax where it falls below the dtype's normal range."""


@pytest.mark.parametrize("dtype", list(SCALED_ROUNDING), ids=["float16", "float8"])
@pytest.mark.parametrize("columns", [1, 1023, 1024, 5000])
def test_scaled_values_round_trip_within_their_rounding(columns, dtype):
    """float16 or e4m3 after a power-of-two scale per block, on mixed magnitudes, an all-zero row, 1e30 (beyond
    float16's range before scaling) and 3e-30 beside -7.5 in one block. float8 travels as uint8, and NaN and Inf
    (which e4m3 lacks) both come back as NaN, for their whole block only; float16 keeps a NaN in place."""
    from tagc.hooks.codecs.codec import SCALE_BLOCK, pack_values, unpack_values, value_wires

    significant, floor_bits = SCALED_ROUNDING[dtype]
    gen = torch.Generator().manual_seed(columns)
    values = torch.randn(3, columns, generator=gen) * torch.exp(8 * torch.randn(3, columns, generator=gen))
    values[1] = 0.0  # an all-zero row
    values[2, 0] = 1e30  # beyond float16's range before scaling
    if columns > 3:
        values[2, 1], values[2, 2] = 3e-30, -7.5  # tiny next to huge in one block
    wires = pack_values(values, dtype)
    assert [(w.shape[1], w.dtype) for w in wires] == [(w.columns, w.dtype) for w in value_wires(columns, dtype)]
    assert wires[0].element_size() == dtype.itemsize
    back = unpack_values(wires)
    blocks = torch.nn.functional.pad(values.abs(), (0, -columns % SCALE_BLOCK)).view(3, -1, SCALE_BLOCK).amax(dim=2)
    floor = torch.repeat_interleave(blocks, SCALE_BLOCK, dim=1)[:, :columns] * 2.0**-floor_bits
    assert ((back - values).abs() <= torch.maximum(values.abs() * 2.0**-significant, floor)).all()
    assert torch.equal(back[1], torch.zeros(columns))
    assert back[2, 0].item() == pytest.approx(1e30, rel=2.0**-significant)
    if dtype == torch.float16:
        poisoned = values.clone()
        poisoned[0, 0] = float("nan")
        assert unpack_values(pack_values(poisoned, dtype))[0, 0].isnan()
    else:
        assert wires[0].dtype == torch.uint8
        assert ((back - values).abs() > values.abs() * 2**-6).any()  # it does round: 4 bits, not float16's 11
        for bad in (float("nan"), float("inf"), -float("inf")):
            poisoned = values.clone()
            poisoned[0, -1] = bad
            out = unpack_values(pack_values(poisoned, dtype))
            last_block = (columns - 1) // SCALE_BLOCK * SCALE_BLOCK
            assert out[0, last_block:].isnan().all() and torch.equal(out[0, :last_block], back[0, :last_block])
            assert torch.equal(out[1:], back[1:])
    assert_denormal_blocks_come_back(dtype, columns)


def assert_denormal_blocks_come_back(dtype: torch.dtype, columns: int) -> None:
    """A block of float32 denormals (down to the smallest, 2**-149) comes back finite, within half a step of the
    dtype's smallest denormal times the scale (float8: 2**-10 * 2**-126) of itself: its scale stops at float32's
    smallest normal instead of underflowing to 0."""
    from tagc.hooks.codecs.codec import pack_values, unpack_values

    tiny = torch.zeros(2, columns)
    tiny[0, 0] = 2.0**-149
    tiny[1, -1] = -3e-42
    back = unpack_values(pack_values(tiny, dtype))
    assert back.isfinite().all() and ((back - tiny).abs() <= 2.0**-136).all()
    if dtype == torch.float16:  # float16's denormals reach 2**-24 * 2**-126: -3e-42 keeps its sign and 3 digits
        assert back[1, -1].item() == pytest.approx(-3e-42, rel=1e-3)


@pytest.mark.parametrize("positions", ["coded", "bitmap"])
def test_tagc_rows_keep_at_most_the_capacity_and_hold_back_the_rest(monkeypatch, positions):
    """A wire that holds fewer entries than the threshold keeps (here 100 of ~3,500): each row
    sends its first 100 above the threshold in index order, exactly; the rest stay in the
    residual and are counted by the rank that held them back."""
    from tagc.hooks.codecs.codec import TAGCCodec
    from tagc.hooks.core.nonfinite import thresholds

    world, numel, cap = 2, 100_000, 100
    real = TAGCCodec._capacity
    monkeypatch.setattr(TAGCCodec, "_capacity", lambda self, n, w: (cap, real(self, n, w)[1]))  # far below the count
    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(world, numel, generator=gen) for _ in range(world)]
    outputs, sent, codecs, stats = exchange("tagc", {"positions": positions}, grads)
    density = codecs[0].config.density(world)
    limit = keep_limit(numel, density)
    for rank, codec in enumerate(codecs):
        tau = thresholds(torch.zeros(world, numel), grads[rank], density, numel)[:, None]
        above, ties = grads[rank].abs() > tau, grads[rank].abs() == tau  # the sample's own entry ties
        kept = codec.residuals[KEY] != grads[rank]
        assert torch.equal(kept, above & (above.cumsum(1) <= cap))  # the first 100 in index order
        by_rule = above.sum(1) + torch.minimum(ties.sum(1), (limit - above.sum(1)).clamp(min=0))
        assert int(stats[rank].overflow) == int((by_rule - cap).sum())
    for owner in range(world):
        torch.testing.assert_close(outputs[0][owner], sent[0][owner].float(), rtol=1e-6, atol=1e-6)
        assert int(stats[owner].unpeeled) == 0


@pytest.mark.parametrize("name", ["tagc", "topk"])
def test_lean_codecs_turn_a_nonfinite_part_nan_and_keep_the_residual(name):
    world, numel = 2, 80_000
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(world, numel, generator=gen) for _ in range(world)]
    grads[1][0, 17] = float("inf")  # in rank 1's part (its row for owner 0): the whole part is poisoned
    outputs, _, codecs, stats = exchange(name, LEAN, grads)
    for owner in range(world):
        assert outputs[0][owner].isnan().all() and int(stats[owner].nonfinite_parts) == 1
    assert torch.equal(codecs[1].residuals[KEY], torch.zeros(world, numel))  # rank 1 kept its residual as it was
    assert codecs[0].residuals[KEY].isfinite().all() and codecs[0].residuals[KEY].abs().sum() > 0


def test_topk_lean_encode_and_decode_never_read_tensors_on_the_host():
    """On the meta device a host read raises: the lean wire has none (the shapes are the planned ones).
    (TAGC's fused compress has no meta kernel; its host reads are counted by the strict-sync test.)"""
    world, numel = 2, 70_001
    codec = make_codec("topk", TAGCConfig(), options=LEAN)
    wires = codec.encode(torch.empty(world, numel, device="meta"), KEY, None)
    assert [(w.shape[1], w.dtype) for w in wires] == [
        (w.columns, w.dtype) for w in codec.wire(numel, world, torch.float32)
    ]
    assert codec.decode(wires, numel, KEY, None, ExchangeStats()).shape == (numel,)


# ----------------------------------------------------------------------------- bad settings


def test_bad_lean_settings_are_clear_errors():
    with pytest.raises(ValueError, match=r"positions must be one of \('bitmap', 'coded'\)"):
        tagc.hook(dense_steps=0, positions="elias")
    with pytest.raises(ValueError, match=r"positions must be one of \('offsets', 'coded'\)"):
        tagc.hook(dense_steps=0, codec="topk", positions="bitmap")
    with pytest.raises(ValueError, match=r"value_dtype must be one of \(.float32., .bfloat16., .float16., .float8.\)"):
        tagc.hook(dense_steps=0, value_dtype=torch.float64)
    with pytest.raises(ValueError, match="use index_bits=1"):
        tagc.hook(dense_steps=0, index_bits=4, positions="coded")
    with pytest.raises(ValueError, match=r"plain must be one of \('fp32', 'bf16', 'fp8', 'int4'\)"):
        tagc.hook(dense_steps=0, plain="fp16")
    with pytest.raises(ValueError, match="takes no options"):
        tagc.hook(dense_steps=0, codec="bf16", positions="coded")


# ----------------------------------------------------------------------------- on 2 gloo ranks

CHUNK = 140_000
PLAIN = 20_000
SEGMENTS = (Segment("w", 0, CHUNK - PLAIN, selected=True), Segment("qkv", CHUNK - PLAIN, PLAIN, selected=False))
PLAIN_BOUND = {"fp32": 0.0, "bf16": 2**-8, "fp8": 2**-3, "int4": 0.3}
"""Relative error of the plain columns' mean for each ``plain=`` codec (its documented rounding)."""


def lean_options(name: str) -> tuple[str, dict]:
    """``"tagc"`` -> ``("tagc", LEAN)``; ``"tagc:float8"``: the lean wire with float8 values instead of bf16."""
    codec, _, values = name.partition(":")
    if codec == "plain":
        return codec, {}
    return codec, {**LEAN, "value_dtype": values} if values else LEAN


def lean_hook(name: str, plain: str):
    name, options = lean_options(name)
    # tagc: the lean wire over the paper's ratio and classic feedback (the byte count below is that codec's)
    return tagc.hook(**paper(codec=name, plain=plain, min_compress_numel=1000, **{"dense_steps": 0, **options}))


def eager_and_traced(rank, world, name, plain):
    eager, traced = lean_hook(name, plain), lean_hook(name, plain)
    gen = torch.Generator().manual_seed(rank)
    grads = [torch.randn(world * CHUNK, generator=gen) for _ in range(2)]
    outs = {"eager": [], "traced": []}
    for grad in grads:
        out, decoded = eager_and_traced_step(eager, traced, grad, SEGMENTS, CHUNK)
        outs["eager"].append(out)
        outs["traced"].append(decoded)
    everyone = [torch.empty_like(grads[0]) for _ in range(world)]
    dist.all_gather(everyone, grads[0])
    exact = sum(g.view(world, CHUNK)[rank] for g in everyone) / world
    plan = eager.plan(SEGMENTS, CHUNK, world)
    row_bytes = sum(w.row_bytes for part in plan.parts for w in part.codec.wire(part.numel, world, torch.float32))
    return outs, exact, row_bytes, eager.stats()["total"]


@pytest.mark.parametrize("name,plain", [("tagc", "bf16"), ("topk", "int4"), ("tagc", "fp32"), ("plain", "fp8"),
                                        ("tagc:float8", "fp32"), ("topk:float8", "bf16")])
def test_two_ranks_lean_eager_equals_traced_and_plain_columns_keep_their_bound(name, plain):
    world = 2
    for outs, exact, row_bytes, total in run_ranks(eager_and_traced, world, name, plain, timeout_s=120):
        assert all(torch.equal(a, b) for a, b in zip(outs["eager"], outs["traced"]))
        plain_out, plain_exact = outs["eager"][0][-PLAIN:], exact[-PLAIN:]
        error = ((plain_out - plain_exact).norm() / plain_exact.norm()).item()
        assert error <= PLAIN_BOUND[plain] + 1e-7, error
        assert total["wire_bytes"] == 2 * (world - 1) * row_bytes
        if name != "plain":
            plain_bytes = {"fp32": 4 * PLAIN, "bf16": 2 * PLAIN + 1}.get(plain)
            if plain_bytes is not None:
                codec, options = lean_options(name)
                sparse = make_codec(codec, TAGCConfig(min_compress_numel=1000), options=options)
                sparse_bytes = sum(w.row_bytes for w in sparse.wire(CHUNK - PLAIN, world, torch.float32))
                assert row_bytes == sparse_bytes + plain_bytes
