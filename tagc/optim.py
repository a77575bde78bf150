"""AdamW whose second moment does not see error feedback's bursts.

An error-feedback codec (``tagc``, ``topk``, ``sign``, ``powersgd``) delivers an element that
waited ``k`` steps as one burst of about ``k`` steps' gradient. Plain AdamW squares the burst
into ``exp_avg_sq``: on an element whose gradient is mostly signal, the second moment grows
about ``k``-fold and the update shrinks about ``sqrt(k)``-fold, so the compressed weights learn
slower than under plain training (``docs/quality-diagnosis.md``).

:class:`AdamW` is ``torch.optim.AdamW`` with one change, on the parameters the hook compressed
this step: ``exp_avg`` still averages the decoded gradient (error feedback keeps its sum
right), but ``exp_avg_sq`` averages the square of *this rank's own* gradient of the shard it
owns, which the hook keeps before it compresses (:class:`tagc.hooks.local_grads.LocalGradients`).
Every other parameter, and every parameter during the hook's dense warm-up, gets
``torch.optim.AdamW``'s own step, bit for bit. The state has ``torch.optim.AdamW``'s keys, so
checkpoints move between the two.

One rank's gradient is noisier than the mean over ``world`` ranks: on elements whose gradient
is mostly noise the second moment reads up to ``world`` times plain's. It is also blind to what
other ranks' batches touch and this rank's does not: embeddings (rows of tokens absent from a
rank's batch are zero there) are therefore not kept (:mod:`tagc.hooks.local_grads`), and an
element whose kept gradient is exactly zero is fed the decoded one. Gradient clipping must
scale the kept gradient as it scales the decoded one: clip with :meth:`AdamW.clip_grad_norm_`
(``torch.nn.utils.clip_grad_norm_`` that remembers its factor for the next step) instead of
calling torch's directly; an unclipped kept gradient (early steps clip by 10x and more) inflates
the second moment for as long as ``beta2`` remembers it.

Use it in place of ``torch.optim.AdamW``, after the hook is installed::

    hook = tagc.hook(feedback="classic")  # the bursts are classic error feedback's; EF21 (tagc's default) sends none
    model.register_comm_hook(hook)
    opt = tagc.optim.AdamW(model.parameters(), hook=hook, lr=3e-4, weight_decay=0.1)
    ...
    loss.backward()
    opt.clip_grad_norm_(1.0)  # in place of torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Union

import torch
from torch.distributed.tensor import DTensor

SECOND_MOMENTS = ("local", "decoded")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (a DTensor's local shard; the tensor itself otherwise)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose second moment, on the parameters ``hook`` compresses, is fed
    each rank's own gradient instead of the decoded one (see the module docstring).

    ``hook``: the installed :func:`tagc.hook`; ``second_moment="decoded"`` (or ``hook=None``)
    makes this exactly ``torch.optim.AdamW``. The other arguments are ``torch.optim.AdamW``'s;
    ``amsgrad``, ``maximize``, ``capturable``, ``differentiable`` and ``fused`` are not supported
    with the local second moment.
    """

    def __init__(self, params: Iterable[Any], hook: Optional[Any] = None, *, second_moment: str = "local",
                 lr: Union[float, torch.Tensor] = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, **options: Any) -> None:
        if second_moment not in SECOND_MOMENTS:
            raise ValueError(f"second_moment must be one of {SECOND_MOMENTS} ('local': each rank's own gradient of "
                             f"the compressed parameters; 'decoded': torch.optim.AdamW's), got {second_moment!r}")
        if (
            hook is not None
            and not hasattr(hook, "local_gradients")
            and hasattr(getattr(hook, "hook", None), "local_gradients")
        ):
            hook = hook.hook  # tagc.ddp_hook's state
        if hook is not None and not hasattr(hook, "local_gradients"):
            raise TypeError(f"hook must be the hook from tagc.hook(...) (or None), got {type(hook).__name__}")
        local = hook is not None and second_moment == "local"
        unsupported = [name for name in ("amsgrad", "maximize", "capturable", "differentiable", "fused")
                       if options.get(name)]
        if local and unsupported:
            raise ValueError(f"tagc.optim.AdamW with second_moment='local' does not support {unsupported}: leave "
                             "them unset, or pass second_moment='decoded' (torch.optim.AdamW's step)")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **options)
        self.hook = hook
        self.second_moment = second_moment
        self._clip_coef: Optional[torch.Tensor] = None  # this step's clip_grad_norm_ factor, for the kept gradients
        if local:
            hook.keep_local_gradients = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over this optimizer's parameters, remembering its factor so
        that the next :meth:`step` scales the kept gradients alike (a kept gradient left unclipped would
        feed the second moment steps the decoded gradient never took). Returns the total norm, as torch's."""
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        norm = total.full_tensor() if isinstance(total, DTensor) else total
        self._clip_coef = torch.clamp(max_norm / (norm.detach() + 1e-6), max=1.0)  # torch's own factor: no host read
        return total

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step; the parameters the hook kept a gradient for take :meth:`_local_step`."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        kept = self.hook.local_gradients.take() if self.hook is not None and self.second_moment == "local" else {}
        held = [(group, p, p.grad) for group in self.param_groups for p in group["params"]
                if p.grad is not None and id(p) in kept]
        for _, p, _ in held:
            p.grad = None  # torch's step skips them
        try:
            super().step()
        finally:
            for _, p, grad in held:
                p.grad = grad
        coef, self._clip_coef = self._clip_coef, None
        for group, p, grad in held:
            self._local_step(group, p, grad, kept[id(p)] if coef is None else kept[id(p)] * coef)
        return loss

    def _local_step(self, group: dict, param: torch.Tensor, grad: torch.Tensor, kept: torch.Tensor) -> None:
        """``torch.optim.AdamW``'s single-tensor step, with ``exp_avg_sq`` fed ``kept`` (flat, the
        padded shard) instead of ``grad``."""
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(
                0.0, dtype=torch.get_default_dtype() if torch.get_default_dtype() == torch.float64 else torch.float32
            )
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        value, gradient = _local(param), _local(grad)
        exp_avg, exp_avg_sq = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
        if kept.numel() < value.numel():
            raise RuntimeError(f"tagc.optim.AdamW: the hook kept {kept.numel()} elements for a parameter shard of "
                               f"{value.numel()}: this layout keeps no whole shard; pass second_moment='decoded'")
        own = kept[: value.numel()].view_as(value).to(value.dtype)
        beta1, beta2 = group["betas"]
        lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]
        state["step"] += 1
        step = float(state["step"])  # a host tensor, as torch.optim keeps it: no device read
        if weight_decay != 0:
            value.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(gradient, 1 - beta1)
        own = torch.where(own == 0, gradient, own)  # an element this rank's batch never touched: the decoded one
        exp_avg_sq.mul_(beta2).addcmul_(own, own, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        value.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
