import pytest
import torch

from llmaccel.engine.sampler import apply_top_k_top_p, make_generator, sample
from llmaccel.engine.sampling_params import SamplingParams
from llmaccel.errors import LLMAccelError


def test_top_k_and_top_p_masks():
    logits = torch.tensor([3.0, 1.0, 2.0, 0.0])
    assert torch.isinf(apply_top_k_top_p(logits, 2, 1.0)).tolist() == [False, True, False, True]
    # probs ~ [0.64, 0.09, 0.24, 0.03]: the nucleus for 0.7 is the top two
    assert torch.isinf(apply_top_k_top_p(logits, -1, 0.7)).tolist() == [False, True, False, True]
    assert torch.isinf(apply_top_k_top_p(logits, -1, 0.5)).tolist() == [False, True, True, True]


def test_greedy_and_seeded_sampling():
    logits = torch.randn(3, 50)
    greedy = SamplingParams(temperature=0)
    hot = SamplingParams(temperature=1.0, seed=7)
    out = sample(logits, [greedy, hot, greedy], [None, make_generator(7, "cpu"), None])
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
    # the seeded row does not depend on its neighbours
    again = sample(logits[1:2], [hot], [make_generator(7, "cpu")])
    assert again[0] == out[1]


def test_sampling_follows_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    gen = make_generator(0, "cpu")
    p = SamplingParams(temperature=1.0)
    counts = torch.bincount(torch.stack([sample(logits, [p], [gen])[0] for _ in range(3000)]),
                            minlength=3).float() / 3000
    torch.testing.assert_close(counts, logits[0].softmax(-1), atol=0.03, rtol=0)


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_k=-2),
                                    dict(max_tokens=0)])
def test_out_of_range_params(kwargs):
    with pytest.raises(LLMAccelError):
        SamplingParams(**kwargs)


def test_min_p_mask():
    logits = torch.tensor([0.0, -1.0, -3.0]).log_softmax(-1)  # p ~ [0.71, 0.26, 0.04]
    assert torch.isinf(apply_top_k_top_p(logits, -1, 1.0, 0.1)).tolist() == [False, False, True]
