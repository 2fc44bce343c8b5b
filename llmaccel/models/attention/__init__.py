from llmaccel.models.attention.backend import AttentionBackend, get_attention_backend
from llmaccel.models.attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
