"""The adapters: the hook on DDP, FSDP1, FSDP2, SimpleFSDP and HSDP, each wrapper's torch internals fenced in its
``torch_*`` module, and ``describe`` (what the hook does to a model).

An adapter turns its wrapper's buckets into the engine's parts and futures; it may import ``core`` and the
codecs' interface, and no other adapter's internals.
"""

from tagc.hooks.adapters import describe, simple
from tagc.hooks.core.engine import ADAPTERS

ADAPTERS.update(bind=simple.bind, describe=describe.describe, warn_if_weak_selection=describe.warn_if_weak_selection)
