"""Speculative decoding: proposers (n-gram lookup, draft model, draft head) draft tokens, the
target model scores them in one step, and the verifier keeps the target's distribution exactly.
"""

from llmaccel.spec.config import SpeculativeConfig, SpeculativeConfigError
from llmaccel.spec.metrics import SpecDecodeStats

__all__ = ["SpecDecodeStats", "SpeculativeConfig", "SpeculativeConfigError"]
