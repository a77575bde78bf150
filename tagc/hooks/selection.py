"""Which parameters TAGC compresses: a policy over parameter names and module types.

Selection is by module role, never by parameter counts. A policy is any callable
``(param_fqn, module) -> bool``; the shipped ones are also reachable by name. A policy may
also return a number, the compression ratio of that parameter (``tagc`` and ``topk``), e.g.
a denser embedding and LM head: :func:`ratio_for`.
"""

from __future__ import annotations

import re
from typing import Callable, Optional, Union

import torch.nn as nn

SelectPolicy = Callable[[str, Optional[nn.Module]], Union[bool, float]]

_ATTENTION_INPUT = re.compile(r"(^|[._])(c_attn|qkv|q_proj|k_proj|v_proj|query|key|value|in_proj\w*|wq|wk|wv)([._]|$)")
_POSITIONAL = re.compile(r"(^|[._])(wpe|pos\w*|position\w*)([._]|$)")


def non_attention_linear(fqn: str, module: Optional[nn.Module] = None) -> bool:
    """GPT-2-style selection (the TAGC paper's): weights of the MLP linears, the attention
    output projection, the token embedding and the LM head. Not the attention QKV
    projection, layer norms, biases or position embeddings."""
    name = fqn.rsplit(".", 1)
    owner, leaf = (name[0], name[1]) if len(name) == 2 else ("", name[0])
    if leaf != "weight":
        return False
    if module is not None and not isinstance(module, (nn.Linear, nn.Embedding)):
        return False
    if module is None and re.search(r"(^|[._])(ln\w*|norm\w*|layernorm\w*)([._]|$)", owner):
        return False
    return not (_ATTENTION_INPUT.search(owner) or _POSITIONAL.search(owner))


def select_all(fqn: str, module: Optional[nn.Module] = None) -> bool:
    """Compress every parameter (buckets below the size floor still go plain)."""
    return True


def select_none(fqn: str, module: Optional[nn.Module] = None) -> bool:
    """Compress nothing: the hook becomes the plain (fair) reduce-scatter."""
    return False


POLICIES: dict[str, SelectPolicy] = {
    "non_attention_linear": non_attention_linear,
    "non-attn": non_attention_linear,
    "all": select_all,
    "none": select_none,
}


def ratio_for(pattern: str, ratio: float, otherwise: Union[str, SelectPolicy] = "non_attention_linear") -> SelectPolicy:
    """A policy that compresses the parameters whose name matches ``pattern`` (``re.search``) at
    ``ratio``, and decides the others by ``otherwise``. E.g. ``ratio_for(r"(^|\\.)(wte|lm_head)\\.", 4)``
    keeps a GPT-2's tied embedding and LM head 2.5x denser than ratio 10 does."""
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 1.0 < float(ratio) < float("inf"):
        raise ValueError(f"ratio must be a finite number > 1, got {ratio!r}")
    matches = re.compile(pattern).search
    base = resolve_policy(otherwise)

    def policy(fqn: str, module: Optional[nn.Module] = None) -> Union[bool, float]:
        return float(ratio) if matches(fqn) else base(fqn, module)

    # the name is the fingerprint every rank compares (TAGCHook.settings)
    policy.__name__ = f"ratio_for({pattern!r}, {float(ratio):g}, {getattr(base, '__name__', repr(base))})"
    return policy


def resolve_policy(select: Union[str, SelectPolicy]) -> SelectPolicy:
    """A policy from its name or a callable; clear error otherwise."""
    if callable(select):
        return select
    if isinstance(select, str) and select in POLICIES:
        return POLICIES[select]
    raise ValueError(f"select must be a callable (fqn, module) -> bool or one of {sorted(POLICIES)}, got {select!r}")
