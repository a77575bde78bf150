"""``gpt2_bench.adam_state``: AdamW's normalised update per kind of weight, read back from a DCP checkpoint."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gpt2_bench.adam_state import LARGE, kind, load_moments, main, pushes

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save without a process group


def _trained(gradient, steps: int = 40) -> dict[str, torch.Tensor]:
    """The checkpoint entries the trainer writes for one AdamW state, after ``steps`` steps of ``gradient(step)``."""
    weight = torch.nn.Parameter(torch.zeros(64, 32))
    opt = torch.optim.AdamW([weight], lr=1e-3)
    for step in range(steps):
        weight.grad = gradient(step)
        opt.step()
    state = opt.state[weight]
    name = "optim.state.transformer.h.3.mlp.c_fc.weight"
    return {f"{name}.step": state["step"].clone(), f"{name}.exp_avg": state["exp_avg"].clone(),
            f"{name}.exp_avg_sq": state["exp_avg_sq"].clone()}


def _saved(tmp_path, entries) -> str:
    path = str(tmp_path / "step-40")
    dcp.save(entries, checkpoint_id=path, no_dist=True)
    return path


def test_a_held_gradient_pushes_at_full_size_and_noise_does_not(tmp_path):
    generator = torch.Generator().manual_seed(0)
    held = torch.randn(64, 32, generator=generator)
    constant = pushes(load_moments(_saved(tmp_path / "held", _trained(lambda step: held))))
    noisy = pushes(load_moments(_saved(tmp_path / "noise", _trained(
        lambda step: torch.randn(64, 32, generator=generator)))))
    (name,) = constant
    assert name == "transformer.h.*.mlp.c_fc.weight" and constant[name].numel == 64 * 32
    assert constant[name].rms == pytest.approx(1.0, abs=1e-3) and constant[name].large == 1.0
    assert noisy[name].rms < 0.5 and noisy[name].large < 0.5


def test_pushes_match_adamw_s_own_update(tmp_path):
    generator = torch.Generator().manual_seed(1)
    entries = _trained(lambda step: torch.randn(64, 32, generator=generator) + 0.3)
    got = pushes(load_moments(_saved(tmp_path, entries)))["transformer.h.*.mlp.c_fc.weight"]
    name = "optim.state.transformer.h.3.mlp.c_fc.weight"
    step = float(entries[f"{name}.step"])
    u = (entries[f"{name}.exp_avg"] / (1 - 0.9**step)) / ((entries[f"{name}.exp_avg_sq"] / (1 - 0.999**step)).sqrt()
                                                        + 1e-8)
    assert got.rms == pytest.approx(float(u.square().mean().sqrt()), rel=1e-5)
    assert got.large == pytest.approx(float((u.abs() > LARGE).float().mean()))


def test_kinds_and_clear_errors(tmp_path, capsys):
    assert kind("transformer.h.11.attn.c_proj.weight") == "transformer.h.*.attn.c_proj.weight"
    assert kind("model.layers.0.mlp.down_proj.weight") == "model.layers.*.mlp.down_proj.weight"
    assert kind("transformer.wte.weight") == "transformer.wte.weight"
    with pytest.raises(FileNotFoundError, match="step-N directory"):
        load_moments(str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="no AdamW state"):
        load_moments(_saved(tmp_path, {"model.w": torch.zeros(3)}))
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--betas", "0.9"])
    assert "--betas takes two numbers" in capsys.readouterr().err
