"""Perplexity through transformers (`llmaccel eval ppl --backend hf`): an independent check of
our engine's forward, over exactly the windows and token ids of eval/perplexity.py.

Each window runs `AutoModelForCausalLM(input_ids=window, labels=labels)` and takes transformers'
own loss. Transformers shifts the labels inside its loss: the label at position t is scored from
the logits at t - 1, and position 0 is never scored. So labels are the window's ids with -100 at
every position before the window's first scored token; the loss is then the mean NLL of exactly
the tokens our engine scores (ids[first:], each from its prefix in the window), and the loss
times their number is the window's NLL sum.
"""

from __future__ import annotations

import torch

from llmaccel.errors import LLMAccelError
from llmaccel.eval.perplexity import PerplexityResult, sliding_window_perplexity

IGNORE_INDEX = -100  # transformers' cross-entropy ignore_index


def load_hf_causal_lm(mc, device: str | torch.device | None = None):
    """transformers' AutoModelForCausalLM for a resolved model source (our ModelConfig): a GGUF
    file through `gguf_file=` (dequantized by transformers, as our loader does), an HF directory
    or a downloaded hub snapshot through from_pretrained; in mc.dtype (fp32 on CPU unless asked
    otherwise), in eval mode on `device`."""
    from transformers import AutoModelForCausalLM

    src = mc.source
    if src.kind == "shape":
        raise LLMAccelError(f"'{mc.name}' is a benchmark shape with random weights; the hf "
                            "backend needs a real checkpoint (a directory, .gguf file or hub id)")
    if src.kind == "gguf":
        directory, file = src.gguf_dir_and_file
        args, kwargs = (directory,), {"gguf_file": file}
    else:
        args, kwargs = (str(src.path),), {}
    try:
        hf = AutoModelForCausalLM.from_pretrained(*args, dtype=mc.dtype, **kwargs)
    except Exception as e:  # transformers' many loading errors, as one line for the CLI
        detail = " ".join(str(e).split()) or type(e).__name__
        raise LLMAccelError(f"transformers cannot load '{mc.name}': {detail}") from e
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return hf.to(dev).eval()


def hf_labels(ids: torch.Tensor, first: int) -> torch.Tensor:
    """Labels for a window whose tokens ids[first:] are scored: -100 before `first`."""
    if not 1 <= first < ids.shape[0]:
        raise LLMAccelError(f"first scored index {first} outside 1..{ids.shape[0] - 1}")
    labels = ids.clone()
    labels[:first] = IGNORE_INDEX
    return labels


def hf_scored_positions(labels: torch.Tensor) -> list[int]:
    """Positions whose token transformers' causal-LM loss scores, by its shift: position t for
    t >= 1 with labels[t] != -100 (scored from the logits at t - 1)."""
    return ((labels[1:] != IGNORE_INDEX).nonzero()[:, 0] + 1).tolist()


@torch.inference_mode()
def hf_window_nll(hf, ids: torch.Tensor, first: int) -> tuple[float, int]:
    """Sum of NLLs (nats) of ids[first:] given their prefix in the window, and how many: one
    transformers forward with labels, its loss (a mean over the scored tokens) times their
    count."""
    labels = hf_labels(ids, first)
    count = len(hf_scored_positions(labels))
    out = hf(input_ids=ids[None], labels=labels[None], use_cache=False)
    return float(out.loss.double()) * count, count


def hf_perplexity(hf, token_ids: list[int] | torch.Tensor, context: int,
                  stride: int | None = None, limit: int | None = None, data: str = "",
                  joining: str = "", progress: bool = False) -> PerplexityResult:
    """Perplexity of a transformers causal LM on a token stream, over `windows()` exactly as
    `perplexity()` does for our model."""
    device = next(hf.parameters()).device
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=device)

    def window_fn(window: torch.Tensor, first: int) -> tuple[float, int]:
        return hf_window_nll(hf, window, first)

    return sliding_window_perplexity(window_fn, ids, context, stride, limit, data=data,
                                     joining=joining, progress=progress, backend="hf")


__all__ = ["IGNORE_INDEX", "hf_labels", "hf_perplexity", "hf_scored_positions", "hf_window_nll",
           "load_hf_causal_lm"]
