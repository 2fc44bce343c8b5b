"""The serving engine: scheduler, block manager, prefix cache, model runner; the LLM API."""

from llmaccel.engine.outputs import CompletionOutput, RequestOutput
from llmaccel.engine.sampling_params import SamplingParams

__all__ = ["CompletionOutput", "LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":  # imported lazily: it pulls in the model stack
        from llmaccel.engine.llm import LLM
        return LLM
    raise AttributeError(name)
