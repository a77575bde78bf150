"""Our SimpleFSDP: sharded parameters all-gathered through a parametrization, traced and
bucketed by ``torch.compile``, with ``model.register_comm_hook(tagc.hook(...))``.

    model = simple_fsdp(GPT(config))                 # Shard(0) DTensors, one bucket per block
    model.register_comm_hook(tagc.hook(ratio=10))    # TAGC on the non-attention linears
    model = compile_model(model)                     # optional: fullgraph, Inductor bucketing
"""

from fsdp_integration.compile import CompileSettings, compile_model
from fsdp_integration.simple_fsdp import MixedPrecisionPolicy, simple_fsdp, units

__all__ = ["CompileSettings", "MixedPrecisionPolicy", "compile_model", "simple_fsdp", "units"]
