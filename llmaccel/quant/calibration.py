"""Calibration token batches for GPTQ/AWQ: random windows of a tokenized text, seeded.

Sources: anything `llmaccel.data.find_text` reads, validation split: `wikitext2` (WikiText-2 raw
validation, never test: test is what perplexity is measured on), `tinyshakespeare`, a UTF-8 text
file, a WikiText-2 directory, or a Hugging Face dataset id. The text is tokenized once as one
stream and `n_samples` windows of `seq_len` tokens are cut at random offsets, the recipe of the
GPTQ paper's reference code, so every sample is full length and needs no padding mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmaccel.errors import LLMAccelError


class CalibrationError(LLMAccelError):
    """A calibration source that cannot be read, or that is too short for the request."""


@dataclass(frozen=True)
class CalibConfig:
    source: str = "wikitext2"
    n_samples: int = 128
    seq_len: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n_samples < 1:
            raise CalibrationError(f"n_samples must be at least 1, got {self.n_samples}")
        if self.seq_len < 2:
            raise CalibrationError(f"seq_len must be at least 2, got {self.seq_len}")


def load_calibration_text(source: str) -> str:
    """The raw text of a calibration source: the validation split of a named dataset, a text
    file, a WikiText-2 directory or a Hugging Face dataset (llmaccel.data.find_text)."""
    from llmaccel.data import find_text

    return find_text(source, "validation").read()


def sample_windows(token_ids: torch.Tensor, n_samples: int, seq_len: int,
                   seed: int = 0) -> torch.Tensor:
    """`n_samples` random windows [n_samples, seq_len] of a 1-D token stream, seeded."""
    token_ids = token_ids.reshape(-1).to(torch.long)
    total = token_ids.numel()
    if total < seq_len:
        raise CalibrationError(f"calibration text has {total} tokens, fewer than "
                               f"seq_len={seq_len}; use a longer text or a smaller --seq-len")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, total - seq_len + 1, (n_samples,), generator=gen)
    return torch.stack([token_ids[s:s + seq_len] for s in starts.tolist()])


def calibration_batches(tokenizer: Any, config: CalibConfig) -> torch.Tensor:
    """Token ids [n_samples, seq_len] from `config.source`, tokenized with `tokenizer` (an HF
    tokenizer) without special tokens: windows start mid-text, so a BOS would be wrong anyway."""
    text = load_calibration_text(config.source)
    # Only as much text as the windows can use (with slack for sampling): tokenizing all of a
    # large user file would dominate the run.
    budget = max(4 * config.n_samples * config.seq_len * 8, 1 << 20)
    ids = tokenizer(text[:budget], add_special_tokens=False)["input_ids"]
    return sample_windows(torch.tensor(ids, dtype=torch.long), config.n_samples, config.seq_len,
                          config.seed)
