from llmaccel.engine.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
