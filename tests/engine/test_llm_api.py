"""The LLM / LLMEngine / AsyncLLM API on a tiny random model: abort, rejection, prefix hit
rate, seeds, n > 1 with copy-on-write, streaming."""

import asyncio

import pytest

from llmaccel import LLM, SamplingParams
from llmaccel.engine.async_llm import AsyncLLM, RequestFailedError
from llmaccel.engine.config import EngineConfig
from llmaccel.engine.llm_engine import LLMEngine
from llmaccel.errors import LLMAccelError
from tiny_models import make_tiny_model, tiny_configs

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-qwen2")
    make_tiny_model(tiny_configs()["qwen2"], directory)
    return str(directory)


def make_llm(model_dir, **kwargs) -> LLM:
    kwargs.setdefault("num_gpu_blocks", 64)
    return LLM(model_dir, dtype="float32", device="cpu", skip_tokenizer_init=True, **kwargs)


def test_abort_mid_generation_frees_blocks(model_dir):
    engine = LLMEngine(EngineConfig(model_dir, dtype="float32", device="cpu",
                                    skip_tokenizer_init=True, num_gpu_blocks=64,
                                    enable_prefix_caching=False))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, n in enumerate([20, 50, 35]):
        engine.add_request(str(i), list(range(1, n + 1)), params)
    for _ in range(3):
        engine.step()
    used = engine.block_manager.num_used_blocks
    held = len(next(s for s in engine.scheduler.running if s.request_id == "1").block_table)
    out = engine.abort_request("1")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert len(out.outputs[0].token_ids) == 3
    assert engine.block_manager.num_used_blocks == used - held
    assert engine.abort_request("1") is None  # unknown (already gone)
    finished = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
    assert sorted(finished) == ["0", "2"]
    assert all(len(o.outputs[0].token_ids) == 40 for o in finished.values())
    assert engine.block_manager.num_used_blocks == 0


def test_abort_waiting_request(model_dir):
    llm = make_llm(model_dir)
    engine = llm.engine
    engine.add_request("a", [1, 2, 3], GREEDY)
    assert engine.abort_request("a").outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests() and not engine.scheduler.waiting


def test_rejected_prompts_do_not_stop_the_others(model_dir):
    llm = make_llm(model_dir, max_model_len=64)
    outs = llm.generate([[5] * 10, [6] * 64, [], [7] * 20, [10_000]], GREEDY, use_tqdm=False)
    assert [o.error is None for o in outs] == [True, False, False, True, False]
    assert "64 tokens" in outs[1].error and "max_model_len" in outs[1].error
    assert "empty" in outs[2].error and "vocabulary" in outs[4].error
    assert len(outs[0].outputs[0].token_ids) == 12 and len(outs[3].outputs[0].token_ids) == 12
    assert llm.engine.block_manager.num_used_blocks == 0


def test_shared_prefix_hit_rate(model_dir):
    """8 requests = one 64-token prefix + 8 unique tokens, submitted together: the first
    computes the 4 prefix blocks, the other 7 reuse them (in the same step), so the hit rate
    is 7 * 64 / (8 * 72)."""
    llm = make_llm(model_dir, block_size=16, enable_prefix_caching=True)
    prefix = list(range(1, 65))
    prompts = [prefix + [100 + i] * 8 for i in range(8)]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.get_stats().prefix_hit_rate == pytest.approx(7 * 64 / (8 * 72))
    assert [o.num_cached_tokens for o in outs] == [0] + [64] * 7
    plain = make_llm(model_dir, enable_prefix_caching=False).generate(prompts, GREEDY,
                                                                       use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]


def test_same_seed_same_output_alone_or_batched(model_dir):
    llm = make_llm(model_dir)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=123, ignore_eos=True)
    alone = llm.generate([[3, 1, 4, 1, 5]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=15 + i, seed=i, ignore_eos=True)
              for i in range(7)]
    prompts = [[2] * (i + 3) for i in range(7)]
    batch = llm.generate(prompts[:3] + [[3, 1, 4, 1, 5]] + prompts[3:],
                         others[:3] + [seeded] + others[3:], use_tqdm=False)
    assert batch[3].outputs[0].token_ids == alone
    unseeded = [o.outputs[0].token_ids for o in batch[:3]]
    assert len({tuple(t) for t in unseeded + [alone]}) == 4  # sampling really samples


def test_n_completions_share_prompt_blocks(model_dir):
    llm = make_llm(model_dir, enable_prefix_caching=False)
    prompt = list(range(1, 24))  # 23 tokens: the last prompt block is partial -> copy-on-write
    greedy = llm.generate([prompt], SamplingParams(n=3, temperature=0, max_tokens=10,
                                                   ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in greedy.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1
    single = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10,
                                                   ignore_eos=True), use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == single.outputs[0].token_ids
    sampled = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=0,
                                                    max_tokens=10, ignore_eos=True),
                           use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in sampled.outputs}) == 4
    # completion i samples with seed + i: alone, that seed gives the same tokens, which holds
    # only if the forks' shared prompt blocks were copied before each wrote its own token
    for i, completion in enumerate(sampled.outputs):
        alone = llm.generate([prompt], SamplingParams(temperature=1.0, seed=i, max_tokens=10,
                                                      ignore_eos=True), use_tqdm=False)[0]
        assert completion.token_ids == alone.outputs[0].token_ids
    assert llm.engine.block_manager.num_used_blocks == 0


def test_stop_token_ids_and_logprobs(model_dir):
    llm = make_llm(model_dir)
    base = llm.generate([[9, 8, 7]], SamplingParams(temperature=0, max_tokens=12,
                                                    ignore_eos=True, logprobs=3),
                        use_tqdm=False)[0].outputs[0]
    assert len(base.logprobs) == 12
    for tok, lp in zip(base.token_ids, base.logprobs):
        assert tok in lp and len(lp) >= 3 and lp[tok] == max(lp.values())  # greedy = top-1
    assert base.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in
                                                        zip(base.token_ids, base.logprobs)))
    stop_at = base.token_ids[4]
    first = base.token_ids.index(stop_at)
    cut = llm.generate([[9, 8, 7]], SamplingParams(temperature=0, max_tokens=12,
                                                   stop_token_ids=[stop_at]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.token_ids == base.token_ids[:first + 1]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop_at)
    later = llm.generate([[9, 8, 7]], SamplingParams(temperature=0, max_tokens=12,
                                                     stop_token_ids=[stop_at],
                                                     min_tokens=first + 2),
                         use_tqdm=False)[0].outputs[0]
    assert len(later.token_ids) >= first + 2 and stop_at not in later.token_ids[:first + 2]


def test_engine_config_errors(model_dir):
    with pytest.raises(LLMAccelError, match="fewer than max_model_len"):
        make_llm(model_dir, num_gpu_blocks=2)
    with pytest.raises(LLMAccelError, match="block_size"):
        make_llm(model_dir, block_size=12)
    with pytest.raises(LLMAccelError, match="max_num_batched_tokens"):
        make_llm(model_dir, enable_chunked_prefill=False, max_num_batched_tokens=16)


def test_async_streaming_and_client_abort(model_dir):
    llm = make_llm(model_dir)
    prompts = [[1, 2, 3], list(range(5, 40)), [7] * 17]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    engine = AsyncLLM(llm.engine)

    async def consume(prompt):
        seen = []
        async for out in engine.generate(prompt, GREEDY):
            seen.append(len(out.outputs[0].token_ids))
            last = out
        assert seen == sorted(seen) and last.finished
        return last.outputs[0].token_ids

    async def leave_early():
        stream = engine.generate([4] * 30, SamplingParams(temperature=0, max_tokens=500,
                                                          ignore_eos=True))
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await stream.aclose()  # what a server does when its client disconnects

    async def main():
        results = await asyncio.gather(*(consume(p) for p in prompts), leave_early())
        await engine.shutdown()
        return results[:3]

    assert asyncio.run(main()) == expected
    assert llm.engine.block_manager.num_used_blocks == 0
    assert not llm.engine.has_unfinished_requests()


def test_coalesced_streams_skip_to_the_newest_output(model_dir):
    """A consumer that falls behind: with coalesce=True it gets only the newest cumulative
    output (the same final tokens, fewer items); without, every step's output."""
    llm = make_llm(model_dir)
    prompt = [3, 4, 5]
    expected = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    engine = AsyncLLM(llm.engine)

    async def slow_consumer(coalesce: bool) -> list[int]:
        lengths = []
        async for out in engine.generate(prompt, GREEDY, coalesce=coalesce):
            lengths.append(len(out.outputs[0].token_ids))
            if len(lengths) == 1:  # fall behind: let the engine finish meanwhile
                while engine.engine.has_unfinished_requests():
                    await asyncio.sleep(0.01)
        assert out.finished and out.outputs[0].token_ids == expected
        return lengths

    async def main():
        result = await slow_consumer(True), await slow_consumer(False)
        await engine.shutdown()
        return result

    coalesced, every = asyncio.run(main())
    assert coalesced == [coalesced[0], len(expected)]  # the first, then straight to the end
    assert every == list(range(every[0], len(expected) + 1))
    assert llm.engine.block_manager.num_used_blocks == 0


def test_a_transient_step_failure_loses_no_request(model_dir, monkeypatch, caplog):
    """A step that fails once is retried (recomputed, its requests one at a time): every
    request finishes with the tokens it would have had, and the failure is logged once."""
    llm = make_llm(model_dir, enable_prefix_caching=True)
    engine = AsyncLLM(llm.engine)
    calls = {"n": 0}
    real_execute = llm.engine.runner.execute

    def flaky(step, *args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated kernel failure")
        return real_execute(step, *args)

    monkeypatch.setattr(llm.engine.runner, "execute", flaky)
    prompts = [list(range(1, 40)), [5] * 33]

    async def consume(prompt):
        out = None
        async for out in engine.generate(prompt, GREEDY):
            pass
        return out.outputs[0].token_ids

    async def main():
        got = await asyncio.gather(*(consume(p) for p in prompts))
        await engine.shutdown()
        return got

    with caplog.at_level("WARNING", logger="llmaccel.engine"):
        got = asyncio.run(main())
    expected = make_llm(model_dir).generate(prompts, GREEDY, use_tqdm=False)
    assert got == [e.outputs[0].token_ids for e in expected]
    logged = [r for r in caplog.records if "simulated kernel failure" in r.getMessage()]
    assert len(logged) == 1 and "2 requests" in logged[0].getMessage()  # once, with the cause
    assert llm.engine.block_manager.num_used_blocks == 0


POISON = 7  # a token id whose presence in a step makes the (simulated) kernel fail


def poisoned_execute(engine, monkeypatch):
    real_execute = engine.runner.execute

    def execute(step, *args):
        if any(POISON in seq.prompt_token_ids for seq, _ in step.scheduled):
            raise RuntimeError("simulated fault on this request's data")
        return real_execute(step, *args)

    monkeypatch.setattr(engine.runner, "execute", execute)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_request_that_fails_a_step_fails_alone(model_dir, monkeypatch, caplog,
                                                   async_scheduling):
    """Among concurrent streams, the one whose data makes every step it is in fail ends with
    RequestFailedError, logged once with the cause; the others finish exactly as they would
    have, the engine keeps serving, and every KV block comes back."""
    llm = make_llm(model_dir, enable_prefix_caching=True, async_scheduling=async_scheduling)
    poisoned_execute(llm.engine, monkeypatch)
    engine = AsyncLLM(llm.engine)
    good = [list(range(10, 40)), [5] * 33, list(range(20, 31))]
    bad = [1, 2, 3, POISON, 9]

    async def consume(prompt, delay=0.0):
        await asyncio.sleep(delay)
        out = None
        async for out in engine.generate(prompt, GREEDY):
            pass
        return out.outputs[0].token_ids

    async def main():
        # the bad request is in a step with others, and one arrives while it is tried alone
        got = await asyncio.gather(consume(good[0]), consume(good[1]), consume(bad),
                                   consume(good[2], 0.01), return_exceptions=True)
        after = await consume(good[0])  # the engine still serves
        await engine.shutdown()
        return got, after

    with caplog.at_level("WARNING", logger="llmaccel.engine"):
        got, after = asyncio.run(main())
    expected = [e.outputs[0].token_ids
                for e in make_llm(model_dir).generate(good, GREEDY, use_tqdm=False)]
    assert [got[0], got[1], got[3]] == expected
    assert after == expected[0]
    assert isinstance(got[2], RequestFailedError)
    assert "simulated fault" in got[2].cause
    retried = [r for r in caplog.records if "one at a time" in r.getMessage()]
    assert retried  # it failed a step of several requests first
    failed = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(failed) == 1 and got[2].request_id in failed[0].getMessage()
    assert "simulated fault" in failed[0].getMessage()
    assert llm.engine.block_manager.num_used_blocks == 0
    assert not llm.engine.requests and not llm.engine.isolation.active
    assert not llm.engine.scheduler.held


def test_generate_returns_the_failed_request_with_its_error(model_dir, monkeypatch):
    llm = make_llm(model_dir)
    poisoned_execute(llm.engine, monkeypatch)
    good = [list(range(10, 40)), list(range(20, 31))]
    outs = llm.generate([good[0], [POISON, 8, 9], good[1]], GREEDY, use_tqdm=False)
    expected = make_llm(model_dir).generate(good, GREEDY, use_tqdm=False)
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == \
        [e.outputs[0].token_ids for e in expected]
    assert outs[0].error is None and outs[2].error is None
    assert outs[1].finished and "simulated fault" in outs[1].error
    assert outs[1].outputs[0].finish_reason == "error"
    assert llm.engine.block_manager.num_used_blocks == 0


def test_a_device_that_fails_every_step_fails_each_request_once(model_dir, monkeypatch,
                                                                 caplog):
    """A fault that is not any request's (every step fails): each request fails, once, with
    the cause, and the engine does not loop."""
    llm = make_llm(model_dir)

    def execute(step, *args):
        raise RuntimeError("simulated device fault")

    monkeypatch.setattr(llm.engine.runner, "execute", execute)
    with caplog.at_level("ERROR", logger="llmaccel.engine"):
        outs = llm.generate([[1, 2, 3], [4, 5, 6], [7, 8]], GREEDY, use_tqdm=False)
    assert all(o.finished and "simulated device fault" in o.error for o in outs)
    assert len([r for r in caplog.records if r.levelname == "ERROR"]) == 3
    assert llm.engine.block_manager.num_used_blocks == 0 and not llm.engine.requests


def test_a_request_whose_text_fails_fails_alone(model_dir, monkeypatch):
    """Host work of one request (its detokenization) raising fails that request only."""
    llm = make_llm(model_dir)
    checker = llm.engine.stop_checker
    real_update = checker.update_text

    def update_text(seq):
        if seq.request_id == "1" and len(seq.output_token_ids) > 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "simulated")
        return real_update(seq)

    monkeypatch.setattr(checker, "update_text", update_text)
    monkeypatch.setattr(checker, "defers_text", lambda seq: False)
    prompts = [list(range(10, 40)), list(range(20, 31)), [3, 4, 5]]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    expected = make_llm(model_dir).generate(prompts, GREEDY, use_tqdm=False)
    assert outs[1].error is not None and "UnicodeDecodeError" in outs[1].error
    for i in (0, 2):
        assert outs[i].error is None
        assert outs[i].outputs[0].token_ids == expected[i].outputs[0].token_ids
    assert llm.engine.block_manager.num_used_blocks == 0


def test_output_kind(model_dir):
    """cumulative (streaming) reports every step; final_only only the finished request; a
    bad value is refused. LLM.generate's results do not depend on it."""
    with pytest.raises(LLMAccelError, match="output_kind"):
        SamplingParams(output_kind="delta-ish")
    llm = make_llm(model_dir)
    expected = llm.generate([[3, 4, 5]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    seen = {}
    for kind in ("cumulative", "final_only"):
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=kind)
        llm.engine.add_request(kind, [3, 4, 5], params)
        outs = []
        while llm.engine.has_unfinished_requests():
            outs += llm.engine.step()
        seen[kind] = outs
    assert len(seen["cumulative"]) == 12 and not seen["cumulative"][0].finished
    assert [len(o.outputs[0].token_ids) for o in seen["cumulative"]] == list(range(1, 13))
    assert len(seen["final_only"]) == 1 and seen["final_only"][0].finished
    for kind in seen:
        assert seen[kind][-1].outputs[0].token_ids == expected


def test_shutdown_aborts_every_running_request_in_one_step(model_dir):
    """Aborting N requests takes the engine once between two steps, not once a step each: a
    drain's deadline is not stretched by N steps, and no request keeps generating meanwhile."""
    llm = make_llm(model_dir)
    engine = AsyncLLM(llm.engine)
    steps = {"n": 0}
    real_step = llm.engine.step

    def counting_step():
        steps["n"] += 1
        return real_step()

    llm.engine.step = counting_step
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def consume(i):
        out = None
        async for out in engine.generate([3 + i, 4, 5], long):
            pass
        return out

    async def main():
        tasks = [asyncio.create_task(consume(i)) for i in range(16)]
        while steps["n"] < 3:  # all 16 were added before the first step: all running
            await asyncio.sleep(0.005)
        before = steps["n"]
        await engine.shutdown(abort_running=True)
        during = steps["n"] - before
        outs = await asyncio.gather(*tasks)
        return during, outs

    during, outs = asyncio.run(main())
    assert during <= 1, f"{during} steps ran while 16 requests were being aborted"
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    assert all(len(o.outputs[0].token_ids) < 200 for o in outs)
    assert llm.engine.block_manager.num_used_blocks == 0
