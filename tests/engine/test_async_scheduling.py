"""Async scheduling (`async_scheduling=True`): the next decode step launched with the previous
step's argmax as input ids, before those tokens reach the host. Outputs must equal the
synchronous engine's exactly, with stops that land while a step is in flight, forks, mixed
sampling, aborts, and every KV block returned. (Greedy equality with transformers under
prefix caching, chunked prefill and preemption is in the engine matrix's async modes.)"""

from __future__ import annotations

import random

import pytest

from llmaccel import LLM, SamplingParams
from llmaccel.engine.llm_engine import PLACEHOLDER_TOKEN
from tiny_models import make_tiny_model, tiny_configs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    make_tiny_model(tiny_configs()["llama"], directory)
    return str(directory)


def _llm(model_dir, async_scheduling, **kw):
    return LLM(model_dir, dtype="float32", device="cpu", skip_tokenizer_init=True,
               block_size=4, async_scheduling=async_scheduling, **kw)


def _workload(seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(160) for _ in range(rng.randint(1, 30))] for _ in range(10)]
    params = []
    for i in range(len(prompts)):
        if i % 3 == 0:  # stops on frequent tokens: sequences end while a step is in flight
            params.append(SamplingParams(temperature=0, max_tokens=40,
                                         stop_token_ids=list(range(0, 160, 7))))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0, max_tokens=rng.randint(1, 30),
                                         ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=25, ignore_eos=True,
                                         min_tokens=5, stop_token_ids=[3, 11]))
    return prompts, params


def _summary(outs):
    return [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def test_async_outputs_equal_sync_outputs(model_dir):
    prompts, params = _workload()
    want = _summary(_llm(model_dir, False).generate(prompts, params, use_tqdm=False))
    llm = _llm(model_dir, True)
    got = _summary(llm.generate(prompts, params, use_tqdm=False))
    assert got == want
    stats = llm.get_stats()
    assert stats.num_async_steps > 0
    assert llm.engine.block_manager.num_used_blocks == 0
    # some requests stopped on a stop id, so a step for them was in flight and dropped
    assert any(c[1] == "stop" for o in want for c in o)


def test_async_with_forks_and_sampling_mixed_in(model_dir):
    prompts = [[5, 6, 7], [9] * 12, [1, 2], [100, 101, 102, 103]]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=3),
              SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True,
                             seed=7),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    want = _llm(model_dir, False).generate(prompts, params, use_tqdm=False)
    llm = _llm(model_dir, True)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert _summary(got) == _summary(want)
    assert got[2].outputs[0].logprobs == want[2].outputs[0].logprobs
    assert llm.engine.block_manager.num_used_blocks == 0


def test_async_steps_run_when_the_batch_only_decodes(model_dir):
    llm = _llm(model_dir, True)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm.generate([[1, 2, 3], [4, 5, 6, 7, 8]], params, use_tqdm=False)
    stats = llm.get_stats()
    # 29 decode steps after the prefill; the last one is never launched ahead (max_tokens)
    assert stats.num_async_steps >= 25


def test_abort_while_a_step_is_in_flight(model_dir):
    """Abort between steps while the engine holds a step launched ahead: the aborted request's
    output holds only real tokens, the others finish as in the sync engine, blocks return."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[3, 4, 5], [6, 7, 8, 9], [10, 11]]
    want = _summary(_llm(model_dir, False).generate(prompts[1:], params, use_tqdm=False))
    llm = _llm(model_dir, True)
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    for _ in range(6):
        eng.step()
    assert eng._ahead is not None  # a step is in flight
    aborted = eng.abort_request("0")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert PLACEHOLDER_TOKEN not in aborted.outputs[0].token_ids
    assert 0 < len(aborted.outputs[0].token_ids) < 24
    finished = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
    assert _summary([finished["1"], finished["2"]]) == want
    while eng._ahead is not None:  # a trailing in-flight step is consumed harmlessly
        eng.step()
    assert eng.block_manager.num_used_blocks == 0
    assert all(PLACEHOLDER_TOKEN not in o.outputs[0].token_ids for o in finished.values())


def test_async_scheduling_is_an_engine_flag():
    from llmaccel.engine.config import EngineConfig

    assert EngineConfig().async_scheduling is True  # the default since measured faster
    assert EngineConfig(async_scheduling=False).async_scheduling is False
