"""TAGC: compressed gradient reduce-scatter for sharded training over slow networks.

``tagc.register_comm_hook(model, tagc.hook())`` on a SimpleFSDP, FSDP2 or FSDP1 model (the defaults: TAGC at
``int4``'s bytes, :data:`tagc.hooks.core.settings.RECOMMENDED`), or a DDP model (every codec as a DDP comm hook;
``tagc.ddp_hook`` gives DDP's ``(state, hook)`` pair). The design: ``docs/design.md``.
"""

from tagc.api import ddp_hook, hook, register_comm_hook
from tagc.config import TAGCConfig
from tagc.hooks.core.engine import TAGCHook

__version__ = "0.1.0"
__all__ = ["TAGCConfig", "TAGCHook", "__version__", "ddp_hook", "hook", "register_comm_hook"]
