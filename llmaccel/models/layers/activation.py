"""SwiGLU's gate: silu(gate) * up on the fused gate_up projection output."""

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.use_triton = False  # set by TransformerForCausalLM.set_fused_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from llmaccel.kernels.activation import silu_and_mul
            return silu_and_mul(x)  # one pass instead of silu, then mul
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
