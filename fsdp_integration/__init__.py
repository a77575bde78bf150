"""Our SimpleFSDP: sharded parameters all-gathered through a parametrization, traced and
bucketed by ``torch.compile``, with a reduce-scatter hook point per unit
(``model.register_comm_hook(hook)``) through which TAGC installs itself:

    model = simple_fsdp(GPT(config))                            # Shard(0) DTensors, one bucket per block
    tagc.register_comm_hook(model, tagc.hook())                 # TAGC on the non-attention linears
    model = compile_model(model)                                # optional: fullgraph, Inductor bucketing

This package depends on torch only: it never imports ``tagc``.
"""

from fsdp_integration.compile import CompileSettings, compile_model
from fsdp_integration.simple_fsdp import MixedPrecisionPolicy, simple_fsdp, units

__all__ = ["CompileSettings", "MixedPrecisionPolicy", "compile_model", "simple_fsdp", "units"]
