"""The held-out split: the last tenth of the blocks, capped at max_heldout_blocks."""

import pytest
import torch

from llmaccel.errors import LLMAccelError
from llmaccel.train.data import split_heldout
from llmaccel.train.distill_common import DistillConfig


def test_split_is_the_last_fraction():
    blocks = torch.arange(100).reshape(50, 2)
    train, held = split_heldout(blocks, 0.1)
    assert len(held) == 5 and torch.equal(held, blocks[-5:]) and torch.equal(train, blocks[:-5])


def test_cap_keeps_the_newest_blocks_and_trains_on_the_rest():
    blocks = torch.arange(200).reshape(100, 2)
    train, held = split_heldout(blocks, 0.1, max_blocks=3)
    assert torch.equal(held, blocks[-3:])  # the newest text (written last)
    assert torch.equal(train, blocks[:-3])
    # a cap above the tenth changes nothing
    assert len(split_heldout(blocks, 0.1, max_blocks=50)[1]) == 10


def test_bad_cap_is_refused():
    with pytest.raises(LLMAccelError, match="max_heldout_blocks"):
        split_heldout(torch.zeros(10, 2), 0.1, max_blocks=0)
    with pytest.raises(LLMAccelError, match="max_heldout_blocks"):
        DistillConfig(target="t", out="o", kind="head", max_heldout_blocks=0).check()
