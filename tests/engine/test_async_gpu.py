"""The engine stepped from threads that never touched CUDA (`-m gpu`, on the device machine).

AsyncLLM runs each step through `asyncio.to_thread`, so a step may land on a worker thread the
pool has just made; the CUDA C kernels launch through the driver API, which needs the calling
thread's context. These drive the engine from fresh threads and at Poisson arrivals, with and
without CUDA graphs, and count failed requests: there must be none."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch

from llmaccel import LLM, SamplingParams
from llmaccel.engine.async_llm import AsyncLLM

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from server_harness import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("tiny-llama"))


def _llm(model_dir, enforce_eager: bool) -> LLM:
    from llmaccel.kernels import cuda_rtc

    assert cuda_rtc.available(), "the CUDA C kernels must be on for this check"
    return LLM(str(model_dir), dtype="bfloat16", device="cuda", max_model_len=256,
               enforce_eager=enforce_eager)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 120) for _ in range(rng.randint(4, 40))] for _ in range(n)]


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_every_step_on_a_new_thread(model_dir, enforce_eager):
    llm = _llm(model_dir, enforce_eager)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for i, p in enumerate(_prompts(8)):
        engine.add_request(f"r{i}", p, params)
    finished, errors = {}, []

    def step() -> None:
        try:
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        except Exception as e:  # re-raised below, in the test's thread
            errors.append(e)

    while engine.has_unfinished_requests() and not errors:
        t = threading.Thread(target=step)  # a thread that has made no CUDA call yet
        t.start()
        t.join()
    assert not errors, errors[0]
    assert len(finished) == 8 and all(not o.error for o in finished.values())
    assert all(len(o.outputs[0].token_ids) == 16 for o in finished.values())


async def _arrivals(engine: AsyncLLM, rate: float | None, n: int) -> list[str | None]:
    """n requests at Poisson arrivals of `rate` req/s (None: all at once); each request's
    error, None where it finished."""
    rng = random.Random(1)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> str | None:
        try:
            last = None
            async for out in engine.generate(prompt, params, request_id=f"a{i}"):
                last = out
            return last.error if last is not None else "no output"
        except Exception as e:
            return f"{type(e).__name__}: {e}"

    tasks = []
    for i, prompt in enumerate(_prompts(n, seed=2)):
        tasks.append(asyncio.create_task(one(i, prompt)))
        if rate is not None:
            await asyncio.sleep(rng.expovariate(rate))
    return await asyncio.gather(*tasks)


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("from_thread", [False, True], ids=["loop", "fresh-thread"])
def test_poisson_arrivals_fail_no_request(model_dir, enforce_eager, from_thread):
    llm = _llm(model_dir, enforce_eager)
    results: dict[str, list[str | None]] = {}

    def drive() -> None:
        async def all_rates() -> None:
            engine = AsyncLLM(llm.engine)
            for rate in (4.0, 16.0, 64.0, None):
                results[str(rate)] = await _arrivals(engine, rate, 48)
            await engine.shutdown()
        asyncio.run(all_rates())

    if from_thread:
        t = threading.Thread(target=drive)
        t.start()
        t.join()
    else:
        drive()
    failed = {rate: [e for e in errs if e] for rate, errs in results.items()}
    assert set(results) == {"4.0", "16.0", "64.0", "None"}
    assert not any(failed.values()), {r: (len(f), f[:1]) for r, f in failed.items()}
    assert llm.engine.block_manager.num_used_blocks == 0
