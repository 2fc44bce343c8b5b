"""Training text -> token blocks: WikiText-2's validation split, a UTF-8 text file (plain, .gz
or .xz), a WikiText-2 directory or a Hugging Face dataset id, found by `llmaccel.data`.

The text is tokenized as one stream and cut into blocks of `seq_len` tokens (the usual causal-LM
recipe: no padding, every position is a training target). The last `heldout` fraction of the
blocks is held out for perplexity and never trained on.

With a record marker (`record_blocks`, e.g. a chat template's system-turn opening) every block
starts where a record starts instead: a chat record (prompt, then answer) cut across two blocks
loses, in its second block, the prompt its answer copies from. A draft head must learn to copy
(rewriting code is full of it), and a copy whose source is out of view teaches it nothing.
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmaccel.errors import LLMAccelError


def load_training_text(data: str) -> str:
    """The training text of `data` (llmaccel.data.find_text): `wikitext2`'s validation split
    (the train split is larger, but the validation split is what every data directory and
    the test data have), a UTF-8 file (plain, .gz or .xz), a WikiText-2 directory, or an HF
    dataset (its train split first)."""
    from llmaccel.data import find_text
    from llmaccel.data import join_rows

    found = find_text(data, training_split(data))
    text = found.read()
    return join_rows(text, "hf") if found.wikitext_rows else text


def training_split(data: str) -> str:
    """A Hugging Face dataset id trains on its train split; a named dataset, a directory and
    a file on the validation split (the same text for a file)."""
    from llmaccel.data import NAMED

    return "validation" if data in NAMED or Path(data).expanduser().exists() else "train"


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


def record_blocks(tokenizer, text: str, seq_len: int, record_start: str,
                  max_blocks: int | None = None) -> torch.Tensor:
    """[n, seq_len] token ids, each block starting at a record (the text split before every
    `record_start`): whole records packed in order while they fit, the rest of the block
    filled with the start of the next record, which then starts the next block (so its start
    is seen twice: no padding, every position still a real target). A record longer than a
    block fills blocks of its own, the last of them ending where it ends."""
    if seq_len < 2:
        raise LLMAccelError(f"seq_len must be >= 2, got {seq_len}")
    if not record_start:
        raise LLMAccelError("record_start must be a non-empty string")
    pieces = text.split(record_start)
    records = [record_start + p for p in pieces[1:]]
    if pieces[0].strip():  # text before the first marker is a record of its own
        records.insert(0, pieces[0])
    if not records:
        raise LLMAccelError(f"the training text has no record starting with {record_start!r}")
    ids = tokenizer(records, add_special_tokens=False)["input_ids"]  # batched: fast ones run
    # it in parallel
    stream = [t for r in ids for t in r]
    starts, at = [], 0
    for r in ids:
        starts.append(at)
        at += len(r)
    blocks: list[list[int]] = []
    i = 0
    while i < len(ids) and (max_blocks is None or len(blocks) < max_blocks):
        begin = starts[i]
        if len(ids[i]) > seq_len:  # a long record: its own blocks, the last ending with it
            end = begin + len(ids[i])
            for b in range(begin, end - seq_len + 1, seq_len):
                blocks.append(stream[b:b + seq_len])
            if (end - begin) % seq_len:
                blocks.append(stream[end - seq_len:end])
            i += 1
            continue
        j = i
        while j < len(ids) and starts[j] + len(ids[j]) - begin <= seq_len:
            j += 1  # records i..j-1 fit whole
        if begin + seq_len > len(stream):
            break  # the text's end: too few tokens left for a whole block
        blocks.append(stream[begin:begin + seq_len])
        i = j
    if max_blocks is not None:
        blocks = blocks[:max_blocks]
    if len(blocks) < 2:
        raise LLMAccelError(f"the training text makes {len(blocks)} record-aligned blocks of "
                            f"{seq_len} tokens: fewer than two (one to train on, one held out)")
    return torch.tensor(blocks, dtype=torch.long)


def split_heldout(blocks: torch.Tensor, fraction: float, max_blocks: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held out): the last `fraction` of the blocks (at least one, at most
    `max_blocks`) is held out."""
    if not 0.0 < fraction < 1.0:
        raise LLMAccelError(f"heldout fraction must be in (0, 1), got {fraction}")
    if max_blocks is not None and max_blocks < 1:
        raise LLMAccelError(f"max_heldout_blocks must be >= 1, got {max_blocks}")
    n_held = max(1, round(len(blocks) * fraction))
    if max_blocks is not None:
        n_held = min(n_held, max_blocks)
    if n_held >= len(blocks):
        raise LLMAccelError(f"{len(blocks)} blocks leave none to train on after holding out "
                            f"{n_held}")
    return blocks[:-n_held], blocks[-n_held:]
