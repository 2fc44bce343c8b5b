"""Calibration token batches for GPTQ/AWQ: random windows of a tokenized text, seeded.

Sources: `wikitext2` (WikiText-2 raw validation, never test: test is what perplexity is measured
on), `tinyshakespeare`, a path to a UTF-8 text file, or a Hugging Face dataset name
(`name` or `name:config`, needs `datasets` and the internet). The text is tokenized once as one
stream and `n_samples` windows of `seq_len` tokens are cut at random offsets, the recipe of the
GPTQ paper's reference code, so every sample is full length and needs no padding mask.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmaccel.errors import LLMAccelError

_DATA_FILES = {
    "wikitext2": Path("wikitext-2-raw") / "wiki.valid.raw",
    "tinyshakespeare": Path("tinyshakespeare") / "input.txt",
}


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


def shared_data_dir() -> Path:
    """`../shared/data` beside the project root, or $LLMACCEL_DATA_DIR."""
    env = os.environ.get("LLMACCEL_DATA_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


def load_calibration_text(source: str) -> str:
    """The raw text of a calibration source (see the module docstring)."""
    if source in _DATA_FILES:
        path = shared_data_dir() / _DATA_FILES[source]
        if not path.is_file():
            raise CalibrationError(f"calibration data {source!r} not found at {path}; set "
                                   "LLMACCEL_DATA_DIR or pass a text file with --calib")
        # HF `datasets` rows of wikitext are its lines; joining lines keeps the same text.
        return path.read_text(encoding="utf-8")
    path = Path(source).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise CalibrationError(f"calibration file {path} is not UTF-8 text") from None
    if source.startswith((".", "/", "~")) or path.suffix in (".txt", ".raw", ".md"):
        raise CalibrationError(f"calibration file {source!r} does not exist")
    return load_hf_dataset_text(source)


def load_hf_dataset_text(name: str, splits: tuple[str, ...] = ("validation", "train", "test"),
                         error: type[LLMAccelError] = CalibrationError) -> str:
    """The 'text' column of a Hugging Face dataset (`name` or `name:config`; needs `datasets`
    and the network), rows joined with a blank line, from the first of `splits` it has.
    Calibration prefers held-out text; training (train/data.py) asks for the train split."""
    try:
        import datasets
    except ImportError:
        raise error(f"{name!r} is neither a known data name nor a file; loading it as a "
                    "Hugging Face dataset needs `pip install datasets`") from None
    repo, _, config = name.partition(":")
    try:
        ds: Any = datasets.load_dataset(repo, config or None)
    except Exception as exc:  # offline, unknown name, gated: all user-side problems
        raise error(f"cannot load dataset {name!r}: {exc}") from None
    split = next((s for s in splits if s in ds), None)
    if split is None or "text" not in ds[split].column_names:
        raise error(f"dataset {name!r} has no {'/'.join(splits)} split with a 'text' column")
    return "\n\n".join(ds[split]["text"])


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
