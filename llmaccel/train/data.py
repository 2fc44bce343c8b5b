"""Training text -> token blocks: WikiText-2 (the validation split from ../shared/data, offline),
a UTF-8 text file, or a Hugging Face dataset name (through `datasets`, which needs the network).

The text is tokenized as one stream and cut into blocks of `seq_len` tokens (the usual causal-LM
recipe: no padding, every position is a training target). The last `heldout` fraction of the
blocks is held out for perplexity and never trained on.
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmaccel.errors import LLMAccelError

_WIKITEXT = Path("wikitext-2-raw") / "wiki.valid.raw"


def load_training_text(data: str) -> str:
    """`wikitext2` (validation split from ../shared/data or $LLMACCEL_DATA_DIR: the train split
    needs the hub), a UTF-8 file, or an HF dataset (`name` or `name:config`, its train split
    first; `datasets`, online)."""
    from llmaccel.eval.perplexity import join_rows
    from llmaccel.quant.calibration import load_hf_dataset_text, shared_data_dir

    if data == "wikitext2":
        path = shared_data_dir() / _WIKITEXT
        if not path.is_file():
            raise LLMAccelError(f"training data 'wikitext2' not found at {path}; set "
                                "LLMACCEL_DATA_DIR or pass a text file with --data")
        return join_rows(path.read_text(encoding="utf-8"), "hf")
    path = Path(data).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise LLMAccelError(f"training file {path} is not UTF-8 text") from None
    if path.suffix or data.startswith((".", "/", "~")):
        raise LLMAccelError(f"training data file {data!r} does not exist")
    return load_hf_dataset_text(data, ("train", "validation", "test"), LLMAccelError)


def token_blocks(tokenizer, text: str, seq_len: int, max_blocks: int | None = None
                 ) -> torch.Tensor:
    """[n, seq_len] token ids: the text as one stream, cut into whole blocks."""
    if seq_len < 2:
        raise LLMAccelError(f"seq_len must be >= 2, got {seq_len}")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    n = len(ids) // seq_len
    if max_blocks is not None:
        n = min(n, max_blocks)
    if n < 2:
        raise LLMAccelError(f"the training text has {len(ids)} tokens: fewer than two blocks "
                            f"of {seq_len} (one to train on, one held out)")
    return torch.tensor(ids[:n * seq_len], dtype=torch.long).view(n, seq_len)


def split_heldout(blocks: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held out): the last `fraction` of the blocks (at least one) is held out."""
    if not 0.0 < fraction < 1.0:
        raise LLMAccelError(f"heldout fraction must be in (0, 1), got {fraction}")
    n_held = max(1, round(len(blocks) * fraction))
    if n_held >= len(blocks):
        raise LLMAccelError(f"{len(blocks)} blocks leave none to train on after holding out "
                            f"{n_held}")
    return blocks[:-n_held], blocks[-n_held:]
