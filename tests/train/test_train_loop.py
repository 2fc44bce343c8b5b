"""train/loop.py: the learning-rate schedules (warm-up, cosine down to a tenth) and the time
limit, which stops training like a last step: evaluated, the best weights restored."""

from __future__ import annotations

import math

import pytest
import torch

from llmaccel.errors import LLMAccelError
from llmaccel.train.loop import train_with_early_stop


def _run(schedule: str, warmup: int, steps: int, max_seconds: float | None = None,
         slow: float = 0.0):
    import time

    w = torch.nn.Parameter(torch.tensor([3.0]))
    lrs: list[float] = []
    opt_step = torch.optim.AdamW.step

    def step_loss(batch):
        if slow:
            time.sleep(slow)
        return (w - 1.0).pow(2).sum()

    def spy(self, *a, **kw):  # the lr each step ran with
        lrs.append(self.param_groups[0]["lr"])
        return opt_step(self, *a, **kw)

    torch.optim.AdamW.step = spy
    try:
        out = train_with_early_stop(
            params=[w], lr=0.1, steps=steps, batch_size=1, eval_every=1000, patience=5,
            seed=0, train=torch.zeros(4, 2, dtype=torch.long), device=torch.device("cpu"),
            step_loss=step_loss, evaluate=lambda: {"loss": float((w.detach() - 1.0).pow(2))},
            metric="loss", metric_name="loss", describe=str,
            snapshot=lambda: w.detach().clone(), restore=lambda s: w.data.copy_(s),
            label="t", status=lambda row: "", progress=False, schedule=schedule,
            warmup=warmup, max_seconds=max_seconds)
    finally:
        torch.optim.AdamW.step = opt_step
    return out, lrs


def test_cosine_schedule_warms_up_then_decays_to_a_tenth():
    _, lrs = _run("cosine", warmup=4, steps=20)
    assert lrs[:4] == pytest.approx([0.1 * s / 5 for s in range(1, 5)])
    assert lrs[4] == pytest.approx(0.1 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 16))))
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))  # never rises after warm-up
    assert lrs[-1] == pytest.approx(0.01)


def test_constant_schedule_keeps_the_learning_rate():
    _, lrs = _run("constant", warmup=0, steps=6)
    assert lrs == pytest.approx([0.1] * 6)
    with pytest.raises(LLMAccelError, match="schedule must be"):
        _run("linear", warmup=0, steps=2)


def test_time_limit_stops_with_an_evaluation():
    out, lrs = _run("constant", warmup=0, steps=10_000, max_seconds=0.05, slow=0.01)
    assert out.stopped and "time limit of 0.05 s" in out.stopped
    assert out.steps_run == len(lrs) < 100
    assert out.history[-1]["step"] == out.steps_run  # evaluated at the stop


def test_a_time_limited_cosine_decays_over_the_time_budget():
    """Cut by the time limit long before its steps run out, the cosine still ends near a
    tenth of the rate: it follows the seconds used where they run out first."""
    out, lrs = _run("cosine", warmup=2, steps=10_000, max_seconds=0.3, slow=0.01)
    assert out.stopped and "time limit" in out.stopped and len(lrs) < 1000
    assert lrs[2] > 0.08  # just after warm-up: near the peak
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))
    assert lrs[-1] < 0.02, lrs[-1]  # by steps alone it would still be ~0.1


def test_a_non_finite_loss_stops_at_its_step_and_restores_the_best():
    """Losses are read back every READ_EVERY steps, not every step: a NaN at step 7 is still
    named by its step, and the weights trained after it are replaced by the best evaluated."""
    from llmaccel.train import loop

    w = torch.nn.Parameter(torch.tensor([3.0]))
    calls = []

    def step_loss(batch):
        calls.append(1)
        loss = (w - 1.0).pow(2).sum()
        return loss * float("nan") if len(calls) == 7 else loss

    out = train_with_early_stop(
        params=[w], lr=0.1, steps=200, batch_size=1, eval_every=1000, patience=5,
        seed=0, train=torch.zeros(4, 2, dtype=torch.long), device=torch.device("cpu"),
        step_loss=step_loss, evaluate=lambda: {"loss": float((w.detach() - 1.0).pow(2))},
        metric="loss", metric_name="loss", describe=str,
        snapshot=lambda: w.detach().clone(), restore=lambda s: w.data.copy_(s),
        label="t", status=lambda row: "", progress=False)
    assert out.stopped == "the training loss is not finite at step 7"
    assert out.steps_run == loop.READ_EVERY  # found at the first read-back
    assert w.item() == 3.0  # the step-0 evaluation's weights, the only one evaluated
