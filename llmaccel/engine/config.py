"""EngineConfig: every engine knob in one frozen place (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass

from llmaccel.errors import LLMAccelError
from llmaccel.spec.config import SpeculativeConfig

# vLLM's --kv-cache-dtype values: "auto" stores K/V in the model dtype; "fp8" and "fp8_e4m3"
# store float8_e4m3fn with per-tensor scales, halving the KV bytes per token.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    load_format: str = "auto"
    hf_overrides: dict | None = None           # set on the HF config (e.g. quantization_config)
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    device: str | None = None
    seed: int = 0
    attention_backend: str = "auto"            # auto | triton | flex | torch
    enforce_eager: bool = False                # no CUDA graphs
    cudagraph_capture_sizes: tuple[int, ...] | None = None  # None: default_capture_sizes
    block_size: int = 16
    kv_cache_dtype: str = "auto"               # auto (model dtype) | fp8 | fp8_e4m3
    num_gpu_blocks: int | None = None          # fixes the KV pool size, overriding the budget
    gpu_memory_utilization: float = 0.9        # fraction of GPU memory for weights + KV + work
    cpu_kv_cache_gib: float = 1.0              # KV budget on CPU
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # per-step token budget (default 8192)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    # Launch the next decode step before this one's tokens reach the host (its input ids come
    # from this step's greedy output on the device), so the GPU never waits on the scheduler:
    # vLLM's --async-scheduling. Applies to greedy steps of an unchanged running set; other
    # steps run as usual. On by default: measured +2-6% W1 tok/s on an H100.
    async_scheduling: bool = True
    # Speculative decoding (vLLM's speculative_config; a dict of SpeculativeConfig's fields is
    # taken too). With it, steps are not launched ahead (the next step's input depends on how
    # many drafts the host accepts).
    speculative_config: SpeculativeConfig | dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, dict):
            object.__setattr__(self, "speculative_config",
                               SpeculativeConfig(**self.speculative_config))
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise LLMAccelError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise LLMAccelError(f"unknown kv_cache_dtype '{self.kv_cache_dtype}' "
                                f"(allowed: {', '.join(KV_CACHE_DTYPES)})")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise LLMAccelError("gpu_memory_utilization must be in (0, 1], got "
                                f"{self.gpu_memory_utilization}")
        if self.max_num_seqs < 1:
            raise LLMAccelError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise LLMAccelError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")
        if self.cudagraph_capture_sizes is not None and any(
                s < 1 for s in self.cudagraph_capture_sizes):
            raise LLMAccelError("cudagraph_capture_sizes must be positive, got "
                                f"{list(self.cudagraph_capture_sizes)}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise LLMAccelError("max_num_batched_tokens must be >= 1, got "
                                f"{self.max_num_batched_tokens}")
