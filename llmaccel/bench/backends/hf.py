"""Backends `hf-eager` and `hf-static-compile`: transformers' `generate` on the same model
(random weights from the config by default, as our dummy load format; speed does not depend
on the values), one request at a time: generate has no continuous batching, so concurrent
requests queue on the client side and their TTFT includes the wait, as a user would see.
A streamer timestamps each new token. `hf-cb` (continuous batching, W2) is aggregate-only
and lives in llmaccel/bench/hf_baselines.py.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from llmaccel.bench import hardware as hw
from llmaccel.bench.backends.base import Backend, BenchRequest, TokenClock, failed
from llmaccel.bench.metrics import RequestResult

HF_EAGER, HF_STATIC = "hf-eager", "hf-static-compile"


class _Stamps:
    """A transformers streamer (put/end) that records when each new token arrives. The first
    put() is the prompt; every later one is one decode step's token(s)."""

    def __init__(self, clock: TokenClock) -> None:
        self.clock, self.seen_prompt, self.tokens = clock, False, 0

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.tokens += int(value.numel())
        self.clock.chunk(time.perf_counter())

    def end(self) -> None:
        pass


class HFBackend(Backend):
    max_concurrency = 1

    def __init__(self, model: str, kind: str = HF_EAGER, dtype: str = "auto",
                 load_format: str = "dummy") -> None:
        if kind not in (HF_EAGER, HF_STATIC):
            raise ValueError(f"HF backend must be {HF_EAGER} or {HF_STATIC}, got {kind!r}")
        self.name, self.model, self.dtype, self._load_format = kind, model, dtype, load_format
        self.hf = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        self.hf = await asyncio.to_thread(self._build)

    def _build(self):
        if self._load_format == "dummy":
            from llmaccel.bench.hf_baselines import build_hf_model

            return build_hf_model(self.model, self.dtype if self.dtype != "auto" else
                                  "bfloat16" if torch.cuda.is_available() else "float32",
                                  hw.default_device())
        from transformers import AutoModelForCausalLM

        hw.release_memory()
        hf = AutoModelForCausalLM.from_pretrained(self.model, dtype=self.dtype)
        return hf.to(hw.default_device()).eval()

    def _generation_config(self, request: BenchRequest):
        from transformers import CompileConfig, GenerationConfig

        eos = self.hf.generation_config.eos_token_id
        eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
        kwargs: dict[str, Any] = {"max_new_tokens": request.max_tokens, "do_sample": False,
                                  "pad_token_id": eos, "eos_token_id": eos}
        if request.ignore_eos:
            kwargs["min_new_tokens"] = request.max_tokens
        if self.name == HF_STATIC:
            kwargs["cache_implementation"] = "static"
            kwargs["compile_config"] = CompileConfig()
        return GenerationConfig(**kwargs)

    def _run(self, request: BenchRequest, clock: TokenClock) -> int:
        if isinstance(request.prompt, str):
            raise ValueError("the HF backends take token-id prompts")
        device = next(self.hf.parameters()).device
        ids = torch.tensor([request.prompt], device=device)
        stamps = _Stamps(clock)
        hw.synchronize(device)
        with torch.inference_mode():
            self.hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             generation_config=self._generation_config(request),
                             streamer=stamps)
        hw.synchronize(device)
        return stamps.tokens

    async def generate(self, request: BenchRequest) -> RequestResult:
        start = time.perf_counter()
        async with self._lock:  # one generate at a time; the wait counts in TTFT
            clock = TokenClock(start)
            try:
                n = await asyncio.to_thread(self._run, request, clock)
            except Exception as e:
                return failed(request, start, e)
        return clock.result(request, n)

    async def close(self) -> None:
        self.hf = None
        if self.name == HF_STATIC:
            torch._dynamo.reset()  # compiled graphs and their CUDA-graph pools hold memory
        hw.release_memory()

    def vocab_size(self) -> int:
        return self.hf.config.vocab_size

    def facts(self) -> dict[str, Any]:
        import transformers

        return {"transformers": transformers.__version__, "dtype": str(self.hf.dtype),
                "load_format": self._load_format,
                "cache": "static" if self.name == HF_STATIC else "dynamic"}

    @property
    def load_format(self) -> str:
        return self._load_format

    def roofline_inputs(self):
        return self.hf, self.hf.config, self.hf.dtype

    def device(self) -> str:
        return hw.device_name(next(self.hf.parameters()).device)
