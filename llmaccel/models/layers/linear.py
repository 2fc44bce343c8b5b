"""Linear layers whose weights come from a quantization method; fused outputs load by shard."""

from __future__ import annotations

import torch
from torch import nn

from llmaccel.models.layers.quantization import QuantizationConfig, UnquantizedLinearMethod


class Linear(nn.Module):
    """y = x W^T (+ b). `output_sizes` lists the fused shards (q/k/v, gate/up) stacked in W.

    Fusing q/k/v and gate/up turns three (two) matmuls into one, which matters most at the
    small batch sizes of decode; checkpoints still load shard by shard.
    """

    def __init__(self, input_size: int, output_sizes: int | list[int], bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.output_size = sum(self.output_sizes)
        self.prefix = prefix
        self.use_triton = False  # set by TransformerForCausalLM.set_fused_kernels
        self.quant_method = (quant_config.get_linear_method(prefix) if quant_config
                             else UnquantizedLinearMethod())
        self.quant_method.create_weights(self, input_size, self.output_sizes,
                                         torch.get_default_dtype())
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size), requires_grad=False)
            self.bias.output_dim = 0
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | None = None) -> None:
        """Copy a checkpoint tensor into `param`, into shard `shard_id` of a fused layer."""
        custom = getattr(param, "weight_loader", None)
        if custom is not None:  # tensors every shard carries whole (GPTQ g_idx, weight_shape)
            custom(param, loaded, shard_id)
            return
        if not param.is_floating_point() and loaded.is_floating_point():
            # copy_ would silently truncate floats into packed integer words
            raise ValueError(f"dtype {loaded.dtype} does not fit packed {param.dtype}")
        target = param.data
        if shard_id is not None:
            dim = getattr(param, "output_dim", 0)
            pack = getattr(param, "packed_factor", 1)  # int4 packs several outputs per element
            offset = sum(self.output_sizes[:shard_id]) // pack
            size = self.output_sizes[shard_id] // pack
            target = target.narrow(dim, offset, size)
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(f"shape {tuple(loaded.shape)} does not fit {tuple(target.shape)}")
        target.copy_(loaded)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_sizes}, bias={self.bias is not None}, "
                f"method={type(self.quant_method).__name__}")
