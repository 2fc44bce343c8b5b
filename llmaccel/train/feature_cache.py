"""The target's features of every training block, computed once and kept on the device.

A head's training step needs the target's last hidden states (after the final norm) of its
batch. Computing them every step runs the whole target forward each step: for the 1.5B Qwen at
8 x 512 tokens that is ~12.6 TFLOP, by estimate a third of a ~110 ms step on an H100 (3,501
steps in 400 s). The features do not change while the head trains, so they can be
computed once per block and read back by index: 7,168 blocks of 512 tokens at hidden size 1536
in bf16 are 11.3 GB. They are kept in the target's dtype, exactly what `target_features`
returns for the block, so a step's loss is the same with or without the cache (up to how the
target's kernels round a different batch).
"""

from __future__ import annotations

import torch

from llmaccel.errors import LLMAccelError

# Of the device memory free when the cache is built, the share it may take: the rest is left
# for the head's training step (its logits over the target's vocabulary are the largest part).
MAX_FREE_SHARE = 0.6


def cache_bytes(blocks: torch.Tensor, hidden_size: int, dtype: torch.dtype) -> int:
    """What caching the features of `blocks` ([n, T] token ids) takes."""
    return blocks.numel() * hidden_size * torch.empty((), dtype=dtype).element_size()


def require_fit(need: int, free: int, num_blocks: int, device) -> None:
    """Raise LLMAccelError unless `need` bytes are within MAX_FREE_SHARE of `free`."""
    if need > MAX_FREE_SHARE * free:
        raise LLMAccelError(
            f"caching the target's features of {num_blocks} blocks needs "
            f"{need / 2**30:.1f} GiB, more than {MAX_FREE_SHARE:.0%} of the "
            f"{free / 2**30:.1f} GiB free on {device}: train without the feature cache, or "
            "on fewer blocks (max_blocks)")


class FeatureCache:
    """features[i]: the target's features of blocks[i], [T, H] in the target's dtype, on the
    target's device. Raises LLMAccelError when they would not fit (MAX_FREE_SHARE of the free
    device memory): a clear error, not a silent switch to computing them per step."""

    def __init__(self, target_model, blocks: torch.Tensor, batch_size: int,
                 compute, width: int | None = None) -> None:
        """`compute(target_model, ids [B, T]) -> [B, T, width]`: train/head_trainer's
        target_features (width: the hidden size, or (1 + aux layers) times it)."""
        param = next(target_model.parameters())
        device, dtype = param.device, param.dtype
        hidden = width or target_model.config.hidden_size
        need = cache_bytes(blocks, hidden, dtype)
        if device.type == "cuda":
            require_fit(need, torch.cuda.mem_get_info(device)[0], len(blocks), device)
        self.features = torch.empty((*blocks.shape, hidden), dtype=dtype, device=device)
        with torch.no_grad():
            for i in range(0, len(blocks), batch_size):
                ids = blocks[i:i + batch_size].to(device)
                self.features[i:i + len(ids)] = compute(target_model, ids)
        self.nbytes = need

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor:
        return self.features[idx.to(self.features.device)]
