"""Greedy selection: each row's argmax and its logprob, stacked for one transfer to the host.
On a GPU the chunked Triton pair of `kernels/greedy.py` (torch reduces a 128k-vocabulary row
in one thread block: 1541 -> 1364 us per llama-3.2-1b batch-1 step on an H100); elsewhere,
and as its reference, torch."""

from __future__ import annotations

import torch

from llmaccel.kernels import triton_available


def greedy_with_logprobs(logits: torch.Tensor, use_kernel: bool = False) -> torch.Tensor:
    """[B, vocab] -> [2, B] float64: argmax ids (exact in float64) and their logprobs.
    Graph-capturable (no host sync). `use_kernel`: the Triton pair where logits are on a GPU
    (the decode graphs and chained draft steps); otherwise torch."""
    if use_kernel and logits.is_cuda and triton_available():
        from llmaccel.kernels.greedy import greedy_sample  # Triton: GPU machines only
        return greedy_sample(logits)
    logits = logits.float()
    tokens = logits.argmax(-1)
    chosen = logits.gather(1, tokens[:, None]).squeeze(1) - logits.logsumexp(-1)
    return torch.stack([tokens.double(), chosen.double()])


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] -> argmax ids [rows], float64, through the kernel on a GPU."""
    return greedy_with_logprobs(logits, use_kernel=True)[0]


def write_greedy_ids(logits: torch.Tensor, ids: torch.Tensor | None, out_f64: torch.Tensor,
                     out_i64: torch.Tensor) -> None:
    """Each row's argmax over `logits` [rows, V], mapped through `ids` [V] where given (a
    draft vocabulary's token ids), into out_f64 and out_i64 [rows]: a chained draft step's
    tokens, as its output and as the next step's input ids. On a GPU one kernel pair
    (kernels/greedy.greedy_ids_into); this torch code is its reference."""
    if logits.is_cuda and triton_available():
        from llmaccel.kernels.greedy import greedy_ids_into  # Triton: GPU machines only

        greedy_ids_into(logits, ids, out_f64, out_i64)
        return
    tokens = greedy_ids(logits).long()
    if ids is not None:
        tokens = ids[tokens]
    out_f64.copy_(tokens)
    out_i64.copy_(tokens)
