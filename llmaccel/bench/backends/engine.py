"""Backend `llmaccel`: our engine in this process, through `AsyncLLM` (the engine a server
runs), so per-token timing is what a streaming client of our server would see minus HTTP."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from llmaccel.bench.backends.base import Backend, BenchRequest, TokenClock, failed
from llmaccel.bench.metrics import RequestResult


class EngineBackend(Backend):
    name = "llmaccel"

    def __init__(self, model: str | None, engine_kwargs: dict[str, Any] | None = None,
                 label: str | None = None) -> None:
        self.model = model
        self.engine_kwargs = dict(engine_kwargs or {})
        self.label = label  # a table variant (e.g. prefix-cache-on)
        self.llm = None

    async def start(self) -> None:
        from llmaccel.engine.async_llm import AsyncLLM

        # Loading takes seconds to minutes: off the event loop, so progress stays live.
        self.llm = await asyncio.to_thread(AsyncLLM.from_config, self.model,
                                           **self.engine_kwargs)

    async def generate(self, request: BenchRequest) -> RequestResult:
        from llmaccel.engine.sampling_params import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=request.max_tokens,
                                ignore_eos=request.ignore_eos)
        clock = TokenClock(time.perf_counter())
        count, text = 0, ""
        try:
            async for out in self.llm.generate(request.prompt, params):
                if out.error:
                    return failed(request, clock.start, out.error)
                completion = out.outputs[0]
                if len(completion.token_ids) > count:
                    clock.chunk(time.perf_counter())
                    count, text = len(completion.token_ids), completion.text
                if completion.finish_reason == "abort":
                    return failed(request, clock.start, "aborted by the engine")
        except Exception as e:  # a rejected or failed request is a result, not a crash
            return failed(request, clock.start, e)
        return clock.result(request, count, text)

    async def close(self) -> None:
        if self.llm is not None:
            await self.llm.shutdown()
            self.llm = None
            from llmaccel.bench import hardware as hw
            hw.release_memory()

    @property
    def engine(self):
        return self.llm.engine

    def vocab_size(self) -> int:
        return self.engine.model_config.hf_config.vocab_size

    def facts(self) -> dict[str, Any]:
        engine = self.engine
        graphs = engine.runner.graphs
        out: dict[str, Any] = {"engine_kwargs": self.engine_kwargs,
                               "dtype": str(engine.model_config.dtype),
                               "cuda_graphs": graphs.sizes if graphs is not None else None,
                               "kv_pool_tokens": engine.get_stats().num_blocks
                               * engine.config.block_size}
        if self.label:
            out["variant"] = self.label
        return out

    @property
    def load_format(self) -> str:
        return self.engine.model_config.load_format

    def roofline_inputs(self):
        mc = self.engine.model_config
        return self.engine.model, mc.hf_config, mc.dtype

    async def engine_stats(self) -> dict[str, Any]:
        stats = await self.llm.get_stats()
        return {"num_preemptions": stats.num_preemptions, "num_steps": stats.num_steps,
                "prefix_hit_rate": round(stats.prefix_hit_rate, 4),
                "spec_decode": stats.spec_decode}

    def device(self) -> str:
        from llmaccel.bench import hardware as hw

        return hw.device_name(self.engine.device)
