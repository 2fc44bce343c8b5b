"""User-facing errors: one clear line naming the problem, shown by the CLI without a traceback."""


class LLMAccelError(Exception):
    """An error caused by the user's input or environment, not by a bug in llmaccel."""


class ModelNotFoundError(LLMAccelError):
    """A model path, hub id or shape name that cannot be found."""


class UnsupportedModelError(LLMAccelError):
    """A model whose architecture or configuration llmaccel does not implement."""


class CorruptCheckpointError(LLMAccelError):
    """A config, safetensors or GGUF file that cannot be parsed."""


class QuantizationError(LLMAccelError, ValueError):
    """Settings or weights a quantizer or checkpoint format cannot take (bits, group size,
    shapes). Also a ValueError: it is a bad argument value."""
