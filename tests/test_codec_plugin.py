"""A new codec is one module plus one registration line: a toy codec defined here, registered with
``register(...)``, runs end to end through ``tagc.hook(codec=...)`` on 2 gloo ranks.

The toy codec casts ``scale * x`` to float16 (``scale`` is its one option, a power of two, so the
scaling itself is exact) and sums the ranks' float16 rows in float32 at the owner. Its decode is
checked against the exact sum of every rank's gradient (float64, gathered independently of the
hook): within float16 rounding, and equal to the sum of the float16-rounded values.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tagc
from tagc.hooks import Segment
from tagc.hooks.codecs.codec import Codec, Wire
from tagc.hooks.codecs.registry import SPECS, codec_names, register
from tagc.hooks.codecs.spec import CodecSpec
from tests.distributed import eager_and_traced_step, run_ranks

ROOT = Path(__file__).resolve().parents[1]
NAME = "fp16-toy"
SCALE = 0.5
CHUNK = 3000
BIAS = 100
SEGMENTS = (Segment("w", 0, CHUNK - BIAS), Segment("bias", CHUNK - BIAS, BIAS, selected=False))


class FP16Codec(Codec):
    """``scale * x`` cast to float16 on the wire (``n`` halves per rank row), summed in float32 and
    divided by ``scale`` at the owner. No state."""

    name = NAME
    compresses = True

    def __init__(self, scale: float = 1.0) -> None:
        if not isinstance(scale, float) or scale <= 0:
            raise ValueError(f"scale must be a positive float, got {scale!r}")
        self.scale = scale

    def wire(self, numel, world, dtype):
        return (Wire(numel, torch.float16),)

    def encode(self, grad, key, group):
        return ((grad.float() * self.scale).to(torch.float16),)

    def decode(self, received, numel, key, group, stats):
        return received[0].sum(dim=0, dtype=torch.float32) / self.scale


FP16_SPEC = CodecSpec(NAME, lambda config, residual_dtype, options: FP16Codec(**options), {"scale": 1.0}, (),
                      "scale * x cast to float16, summed in float32 at the owner (a test's toy codec)")

register(FP16_SPEC)  # the one registration line (a library codec's lives in tagc.hooks.codecs.registry)


@pytest.fixture(autouse=True, scope="module")
def _unregister_at_the_end():
    """The toy codec leaves the registry when this module's tests are done (ranks are processes of their own)."""
    yield
    SPECS.pop(NAME, None)


def _toy_hook(**settings):
    return tagc.hook(codec=NAME, scale=SCALE, select="all", min_compress_numel=1000, dense_steps=0, **settings)


def toy_codec_on_ranks(rank: int, world: int):
    """One step of the toy codec through the eager path and the traced halves; every rank's gradient
    gathered (outside the hook) for the exact sum."""
    eager, traced = _toy_hook(), _toy_hook()
    grad = torch.randn(world * CHUNK, generator=torch.Generator().manual_seed(100 + rank)) * 3.0
    out, decoded = eager_and_traced_step(eager, traced, grad, SEGMENTS, CHUNK)
    everyone = [torch.empty_like(grad) for _ in range(world)]
    dist.all_gather(everyone, grad)
    mine = torch.stack([g.view(world, CHUNK)[rank] for g in everyone])  # [ranks, CHUNK]: every rank's row for me
    return out, decoded, mine, eager.stats()["total"]["wire_bytes"], traced.stats()["total"]["wire_bytes"]


def test_a_registered_toy_codec_runs_end_to_end_on_two_ranks():
    world = 2
    for out, decoded, rows, eager_bytes, traced_bytes in run_ranks(toy_codec_on_ranks, world):
        assert torch.equal(out, decoded)  # eager and traced: the codec's wire shapes follow from its settings
        rows = rows.double()
        exact = rows.sum(dim=0) / world  # ReduceOp.AVG
        selected = slice(0, CHUNK - BIAS)
        # the selected columns: the sum of the float16-rounded values (float32 accumulation: 2 adds)
        rounded = ((rows * SCALE).half().double() / SCALE).sum(dim=0) / world
        torch.testing.assert_close(out[selected].double(), rounded[selected], rtol=2e-7, atol=1e-9)
        # ... within float16's rounding of each rank's value (unit roundoff 2^-11), and really rounded
        bound = rows.abs().sum(dim=0) * 2.0**-11 / world + 1e-6
        error = (out.double() - exact).abs()
        assert (error[selected] <= bound[selected]).all()
        assert (error[selected] > 0).sum() > (CHUNK - BIAS) // 2  # float16 on the wire, not the plain codec
        # the unselected bias goes through the plain codec: exact up to float32's own sum
        torch.testing.assert_close(out[-BIAS:].double(), exact[-BIAS:], rtol=2e-7, atol=1e-9)
        # the bytes are the toy codec's wire: float16 for the selected columns, float32 for the bias
        assert eager_bytes == traced_bytes == (world - 1) * ((CHUNK - BIAS) * 2 + BIAS * 4)


def test_the_registry_checks_the_toy_codecs_name_and_options():
    assert NAME in codec_names()
    assert isinstance(_toy_hook().codec, FP16Codec) and _toy_hook().codec.scale == SCALE
    with pytest.raises(ValueError, match=r"codec 'fp16-toy' takes options \('scale',\); got 'block'"):
        tagc.hook(codec=NAME, block=64)
    with pytest.raises(ValueError, match=r"ratio applies only to codecs \('tagc', 'topk'\), not to codec 'fp16-toy'"):
        tagc.hook(codec=NAME, ratio=10)
    with pytest.raises(ValueError, match="scale must be a positive float"):
        tagc.hook(codec=NAME, scale=-1.0)
    with pytest.raises(ValueError, match="registered twice"):
        register(FP16_SPEC)
    with pytest.raises(TypeError, match="CodecSpec"):
        register(FP16Codec)


def _files_that(found) -> dict[str, list[int]]:
    """Project modules outside tests/ with AST nodes ``found(node)`` says yes to, with their lines."""
    hits: dict[str, list[int]] = {}
    for package in ("tagc", "fsdp_integration", "gpt2_bench", "testbed", "backward_drain"):
        for path in sorted((ROOT / package).rglob("*.py")):
            lines = sorted({node.lineno for node in ast.walk(ast.parse(path.read_text(), str(path))) if found(node)})
            if lines:
                hits[str(path.relative_to(ROOT))] = lines
    return hits


def _imports_sign(node: ast.AST) -> bool:
    """An import of ``tagc.hooks.codecs.sign`` or of a name from it."""
    if isinstance(node, ast.Import):
        return any(alias.name == "tagc.hooks.codecs.sign" for alias in node.names)
    if isinstance(node, ast.ImportFrom):
        return node.module == "tagc.hooks.codecs.sign" or (node.module == "tagc.hooks.codecs"
                                                     and any(alias.name == "sign" for alias in node.names))
    return False


def _names_sign_codec(node: ast.AST) -> bool:
    return ((isinstance(node, ast.Name) and node.id == "SignCodec") or (isinstance(node, ast.Attribute)
            and node.attr == "SignCodec") or (isinstance(node, ast.ClassDef) and node.name == "SignCodec"))


def test_the_sign_codec_is_one_module_and_one_registration_line():
    """``tagc.hooks.codecs.sign`` holds the sign codec and its spec; the registry imports it and registers its
    spec in one line; no other module imports it or names its class (they reach it by its registered name)."""
    assert list(_files_that(_names_sign_codec)) == ["tagc/hooks/codecs/sign.py"]
    registry = "tagc/hooks/codecs/registry.py"
    importers = _files_that(_imports_sign)
    assert list(importers) == [registry]
    uses = _files_that(lambda node: isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                       and node.value.id == "sign")[registry]
    lines = (ROOT / registry).read_text().splitlines()
    assert [lines[line - 1] for line in uses] == ["register(sign.SPEC)"]
