"""llmaccel: analyze, fine-tune, quantize, speculate, serve and measure causal LMs."""

from llmaccel.version import __version__

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy, so `import llmaccel` stays cheap for the CLI and tools that need no model.
    if name == "LLM":
        from llmaccel.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from llmaccel.engine.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(name)
