"""tagc.optim.AdamW: torch.optim.AdamW bit for bit where no gradient was kept; on the compressed
parameters a second moment fed each rank's own gradient, which the hook keeps exactly (SimpleFSDP,
FSDP2 and DDP on 2 gloo ranks, against a single-process model on the rank's own batch)."""

from __future__ import annotations

import pytest
import torch

import tagc
from fsdp_integration import simple_fsdp
from gpt2_bench.model import GPT, GPTConfig
from tagc.hooks.local_grads import LocalGradients
from tagc.hooks.segment import Segment
from tests.distributed import run_ranks

VOCAB = 101  # dim 0 of the embedding does not divide the world size: padded shards
PER_RANK = 2


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(7, 5, generator=gen)), torch.nn.Parameter(torch.randn(5, generator=gen))]


def _grads(params, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 10 ** (step % 3 - 1)  # mixed magnitudes across steps


def test_without_a_kept_gradient_it_is_torch_adamw_bit_for_bit():
    ours, theirs = _params(0), _params(0)
    options = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6)
    opt = tagc.optim.AdamW([{"params": ours[:1], "weight_decay": 0.1}, {"params": ours[1:], "weight_decay": 0.0}],
                           hook=tagc.hook(ratio=4, index_bits=1), **options)
    ref = torch.optim.AdamW([{"params": theirs[:1], "weight_decay": 0.1}, {"params": theirs[1:], "weight_decay": 0.0}],
                            **options)
    for step in range(6):
        _grads(ours, step), _grads(theirs, step)
        opt.step(), ref.step()
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])
    assert opt.state_dict()["state"].keys() == ref.state_dict()["state"].keys()


class _Module(torch.nn.Module):
    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


class _FakeHook:
    def __init__(self) -> None:
        self.local_gradients = LocalGradients()
        self.keep_local_gradients = False


def test_a_kept_gradient_feeds_the_second_moment_and_the_decoded_one_the_first():
    """Against AdamW written out in float64: m from the decoded gradient, v from the kept one (padded:
    the store holds more elements than the shard, as a padded shard does)."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
    module, hook = _Module(weight), _FakeHook()
    opt = tagc.optim.AdamW([weight], hook=hook, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    assert hook.keep_local_gradients
    segment = Segment("block.weight", 0, 14, module)
    w, m, v = weight.detach().clone(), torch.zeros(4, 3, dtype=torch.float64), torch.zeros(4, 3, dtype=torch.float64)
    for step in range(1, 5):
        decoded = torch.randn(4, 3, dtype=torch.float64) * (step % 2)  # zero on odd steps: a burst on even ones
        own = torch.randn(14, dtype=torch.float64)
        own[step] = 0.0  # an element this rank's batch never touched: v takes the decoded gradient there
        weight.grad = decoded.clone()
        hook.local_gradients.keep([segment], own, 0.5)
        opt.step()
        own = (own[:12] * 0.5).view(4, 3)
        own = torch.where(own == 0, decoded, own)
        w = w * (1 - 1e-2 * 0.1)
        m = 0.9 * m + 0.1 * decoded
        v = 0.99 * v + 0.01 * own * own
        w = w - 1e-2 / (1 - 0.9**step) * m / ((v / (1 - 0.99**step)).sqrt() + 1e-8)
        torch.testing.assert_close(weight.detach(), w, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(opt.state[weight]["exp_avg_sq"], v, rtol=1e-12, atol=1e-15)
    assert len(hook.local_gradients) == 0  # taken


def test_embeddings_are_not_kept():
    """A rank's embedding gradient is zero on rows of tokens only other ranks saw: never kept."""
    store = LocalGradients()
    embedding, linear = torch.nn.Embedding(3, 2), torch.nn.Linear(2, 3, bias=False)
    store.keep([Segment("wte.weight", 0, 6, embedding), Segment("fc.weight", 6, 6, linear)], torch.arange(12.0), 1.0)
    kept = store.take()
    assert list(kept) == [id(linear.weight)] and torch.equal(kept[id(linear.weight)], torch.arange(6.0, 12.0))


def test_bad_arguments_say_what_to_do():
    params = _params(0)
    with pytest.raises(ValueError, match="second_moment must be one of"):
        tagc.optim.AdamW(params, hook=tagc.hook(), second_moment="frozen")
    with pytest.raises(TypeError, match="tagc.hook"):
        tagc.optim.AdamW(params, hook=object())
    with pytest.raises(ValueError, match="amsgrad"):
        tagc.optim.AdamW(params, hook=tagc.hook(), amsgrad=True)
    tagc.optim.AdamW(params, hook=tagc.hook(), second_moment="decoded", amsgrad=True)  # torch's own step: allowed


# ----------------------------------------------------------------------------- 2 gloo ranks


def _batch(seed: int, world: int):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (PER_RANK * world, 16), generator=gen)
    return idx, torch.randint(0, VOCAB, (PER_RANK * world, 16), generator=gen)


def _mine(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    return tensor[PER_RANK * rank : PER_RANK * (rank + 1)]


def _own_shard(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    rows = -(-full.shape[0] // world)
    return full[rank * rows : (rank + 1) * rows].reshape(-1)


def _kept_equals_own_gradient(rank, world, integration, dense_steps):
    torch.manual_seed(0)
    config = GPTConfig.preset("tiny", vocab_size=VOCAB, n_embd=64)
    reference, model = GPT(config), GPT(config)
    model.load_state_dict(reference.state_dict())
    hook = tagc.hook(ratio=4, index_bits=1, dense_steps=dense_steps, min_compress_numel=1)
    if integration == "simple":
        model = simple_fsdp(model)
        model.register_comm_hook(hook)
    elif integration == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        tagc.register_comm_hook(model, hook)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.05)
        tagc.register_comm_hook(model, hook)
    opt = tagc.optim.AdamW(model.parameters(), hook=hook, lr=1e-3)
    names = dict(model.named_parameters())
    checked, errors, steps_kept = set(), [], []
    for step in range(3):
        idx, tgt = _batch(step, world)
        model(_mine(idx, rank), _mine(tgt, rank))[1].backward()
        with torch.no_grad():  # the reference at the model's weights
            for n, p in reference.named_parameters():
                q = names.get(n, names.get(f"module.{n}"))
                if q is not None:
                    p.copy_(q.full_tensor() if hasattr(q, "full_tensor") else q)
        reference.zero_grad()
        reference(_mine(idx, rank), _mine(tgt, rank))[1].backward()  # this rank's own gradient
        ref = {n.removeprefix("module."): p.grad for n, p in reference.named_parameters()}
        kept = {}
        for segment, gradient in hook.local_gradients._kept.values():
            kept[segment.name.removeprefix("module.")] = gradient
        steps_kept.append(len(kept))
        for name, gradient in kept.items():
            own = ref[name].reshape(-1) if integration == "ddp" else _own_shard(ref[name], rank, world)
            errors.append((gradient[: own.numel()] - own).abs().max().item())
            checked.add(name)
        opt.step()
        opt.zero_grad()
    compressed = {
        n.removeprefix("module.") for n, p in names.items() if p.dim() >= 2 and "wte" not in n
    }  # not the embedding
    return {"errors": errors, "checked": checked, "compressed": compressed, "steps_kept": steps_kept}


@pytest.mark.parametrize("integration", ["simple", "fsdp2", "ddp"])
def test_the_hook_keeps_each_ranks_own_gradient_of_its_shard(integration):
    for result in run_ranks(_kept_equals_own_gradient, 2, integration, 1, timeout_s=300):
        assert result["steps_kept"][0] == 0  # the dense warm-up keeps nothing: torch's step
        assert result["steps_kept"][-1] > 0  # DDP settles its buckets in its first step
        assert result["checked"] and result["checked"] <= result["compressed"]
        assert max(result["errors"]) < 1e-6


def test_clip_grad_norm_scales_the_kept_gradient_as_the_decoded_one():
    """torch's clip factor (max_norm / (norm + 1e-6)) reaches the kept gradient; the next step forgets it."""
    weight = torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.float64))
    module, hook = _Module(weight), _FakeHook()
    opt = tagc.optim.AdamW([weight], hook=hook, lr=1e-2, betas=(0.9, 0.5), weight_decay=0.0)
    segment = Segment("block.weight", 0, 6, module)
    decoded, own = torch.full((3, 2), 3.0, dtype=torch.float64), torch.full((6,), 4.0, dtype=torch.float64)
    weight.grad = decoded.clone()
    hook.local_gradients.keep([segment], own, 1.0)
    norm = opt.clip_grad_norm_(0.5)
    coef = 0.5 / (float(norm) + 1e-6)
    assert float(norm) == pytest.approx(54 ** 0.5) and torch.allclose(weight.grad, decoded * coef)
    opt.step()
    torch.testing.assert_close(opt.state[weight]["exp_avg_sq"], torch.full((3, 2), 0.5 * (4.0 * coef) ** 2,
                                                                             dtype=torch.float64))
    weight.grad = decoded.clone()
    hook.local_gradients.keep([segment], own, 1.0)
    opt.step()  # no clip this step: the kept gradient as it is
    expected = 0.5 * 0.5 * (4.0 * coef) ** 2 + 0.5 * 16.0
    torch.testing.assert_close(opt.state[weight]["exp_avg_sq"], torch.full((3, 2), expected, dtype=torch.float64))
