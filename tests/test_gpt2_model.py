"""GPT-2 model of the benchmark: shapes, loss at init, weight tying, sizes, and what TAGC selects."""

import math

import pytest
import torch

from gpt2_bench.model import GPT, PRESETS, GPTConfig
from tagc.hooks.core.selection import non_attention_linear


def tiny(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", **overrides))


def owned_parameters(model: torch.nn.Module):
    """(fqn, owning module) of each distinct parameter, named as ``named_parameters`` names it."""
    owners = {}
    for mod_name, mod in model.named_modules():
        for leaf, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), (f"{mod_name}.{leaf}" if mod_name else leaf, mod))
    return [owners[id(p)] for _, p in model.named_parameters()]


def test_forward_backward_shapes():
    model = tiny()
    idx = torch.randint(0, model.config.vocab_size, (2, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 16, model.config.vocab_size)
    assert loss.shape == ()
    loss.backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    logits, loss = model(idx)  # generation path: last position only
    assert logits.shape == (2, 1, model.config.vocab_size) and loss is None


def test_shifted_targets_need_not_be_contiguous():
    model = tiny()
    tokens = torch.randint(0, model.config.vocab_size, (2, 17))
    _, loss = model(tokens[:, :-1], tokens[:, 1:])  # a strided view, as nanoGPT's callers write it
    _, expected = model(tokens[:, :-1], tokens[:, 1:].contiguous())
    assert torch.equal(loss, expected)


def test_loss_at_init_is_log_vocab():
    model = tiny()
    idx = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))
    _, loss = model(idx, torch.roll(idx, -1, 1))
    assert loss.item() == pytest.approx(math.log(model.config.vocab_size), rel=0.10)


def test_attention_is_causal():
    model = tiny().eval()
    idx = torch.randint(0, 100, (1, 12))
    changed = idx.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 100
    with torch.no_grad():
        a = model.lm_head(model.transformer.ln_f(_hidden(model, idx)))
        b = model.lm_head(model.transformer.ln_f(_hidden(model, changed)))
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def _hidden(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    x = model.transformer.wte(idx) + model.transformer.wpe(torch.arange(idx.size(1)))
    for block in model.transformer.h:
        x = block(x)
    return x


def test_weight_tying():
    tied, untied = tiny(), tiny(tie_weights=False)
    assert tied.lm_head.weight is tied.transformer.wte.weight
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    assert untied.num_params() - tied.num_params() == 64 * tied.config.vocab_size
    idx = torch.randint(0, 1000, (2, 8))
    tied(idx, idx)[1].backward()
    assert tied.transformer.wte.weight.grad is not None


def test_residual_projection_init_is_scaled():
    model = GPT(GPTConfig.preset("small"))
    std = 0.02 / math.sqrt(2 * model.config.n_layer)
    assert model.transformer.h[0].mlp.c_proj.weight.std().item() == pytest.approx(std, rel=0.05)
    assert model.transformer.h[0].mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_preset_sizes_on_meta_device():
    with torch.device("meta"):
        gpt2 = GPT(GPTConfig.preset("gpt2"))
        untied = GPT(GPTConfig.preset("gpt2-untied"))
    assert gpt2.num_params() == pytest.approx(124e6, rel=0.01)
    assert gpt2.num_params(non_embedding=True) == 123_653_376  # nanoGPT's "123.65M"
    assert untied.num_params() - gpt2.num_params() == 50257 * 768
    assert untied.num_params() == pytest.approx(163e6, rel=0.01)  # the paper's "~162M"
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight


def test_presets_and_errors():
    assert set(PRESETS) >= {"gpt2", "gpt2-untied", "tiny", "small"}
    cfg = GPTConfig.preset("tiny", dropout=0.1, vocab_size=50257)
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.dropout, cfg.vocab_size) == (
        2,
        2,
        64,
        64,
        0.1,
        50257,
    )
    assert PRESETS["tiny"].dropout == 0.0  # presets are not mutated
    with pytest.raises(ValueError, match="unknown GPT-2 preset"):
        GPTConfig.preset("gpt5")
    with pytest.raises(ValueError, match="block size"):
        tiny()(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.parametrize("tie", [True, False])
def test_selection_policy_picks_non_attention_linears(tie):
    model = tiny(tie_weights=tie)
    chosen = {name for name, module in owned_parameters(model) if non_attention_linear(name, module)}
    expected = {"transformer.wte.weight"} | ({"lm_head.weight"} if not tie else set())
    for i in range(model.config.n_layer):
        expected |= {
            f"transformer.h.{i}.attn.c_proj.weight",
            f"transformer.h.{i}.mlp.c_fc.weight",
            f"transformer.h.{i}.mlp.c_proj.weight",
        }
    assert chosen == expected
    # by name alone (the FSDP1 path passes no module) the answer is the same
    assert {name for name, _ in model.named_parameters() if non_attention_linear(name, None)} == expected
