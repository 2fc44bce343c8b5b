"""Build the model straight on its device in its dtype, then fill it from safetensors, GGUF
or random (dummy) weights. No full fp32 copy of a half-precision model is ever made: tensors
arrive one at a time and are cast as they are copied in."""

from __future__ import annotations

import contextlib
import json
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch

from llmaccel.errors import CorruptCheckpointError, LLMAccelError
from llmaccel.kernels import triton_available
from llmaccel.models.attention.backend import resolve_backend_name
from llmaccel.models.config import ModelConfig
from llmaccel.models.l2_prefetch import link_l2_prefetch
from llmaccel.models.layers.linear import Linear
from llmaccel.models.layers.quantization import QuantizationConfig
from llmaccel.models.transformer import TransformerForCausalLM

Weights = Iterator[tuple[str, torch.Tensor]]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def get_model(model_config: ModelConfig, device: str | torch.device = "cpu",
              quant_config: QuantizationConfig | None = None,
              attention_backend: str = "auto", seed: int = 0,
              progress: bool = False, fused_kernels: bool | None = None
              ) -> TransformerForCausalLM:
    """`attention_backend` 'auto' picks triton on CUDA, torch elsewhere; `fused_kernels`
    (None: on with CUDA and Triton) routes norms, rotary and activations through Triton."""
    device = torch.device(device)
    attention_backend = resolve_backend_name(attention_backend, device)
    quant_config = quant_config or model_config.quant_config
    with torch.device(device), _default_dtype(model_config.dtype):
        model = TransformerForCausalLM(model_config.hf_config, model_config.max_model_len,
                                       quant_config, attention_backend)
    if model_config.load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        weights = (safetensors_weights(model_config.source.path, device)
                   if model_config.load_format == "safetensors"
                   else gguf_weights(model_config, device))
        if quant_config is not None:
            weights = quant_config.checkpoint_weights(weights)
        if progress:
            weights = _with_progress(weights, _checkpoint_tensor_count(model),
                                     f"loading {model_config.name}")
        _load_checked(model, weights, model_config)
    for module in model.modules():
        if isinstance(module, Linear):
            module.quant_method.process_weights_after_loading(module)
    if fused_kernels is None:
        fused_kernels = device.type == "cuda" and triton_available()
    model.set_fused_kernels(fused_kernels)
    if device.type == "cuda":  # after the kernel layouts exist: it records their addresses
        link_l2_prefetch(model)
    if quant_config is not None:  # after set_fused_kernels: the log names the kernel in use
        from llmaccel.models.layers.quant_configs import log_linear_methods
        log_linear_methods(model, model_config.name)
    return model.eval()


def _load_checked(model: TransformerForCausalLM, weights: Weights, mc: ModelConfig) -> None:
    try:
        loaded = model.load_weights(weights)
    except KeyError as e:
        raise CorruptCheckpointError(f"checkpoint tensor {e} of '{mc.name}' has no place in "
                                     f"{mc.architecture}") from e
    except ValueError as e:
        raise CorruptCheckpointError(f"checkpoint '{mc.name}' does not match its config: {e}") \
            from e
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        raise CorruptCheckpointError(f"checkpoint '{mc.name}' lacks {len(missing)} weights "
                                     f"(first: {missing[0]})")


def _checkpoint_tensor_count(model: torch.nn.Module) -> int:
    """How many HF tensors fill the model: a fused q/k/v parameter takes three."""
    return sum(len(m.output_sizes) if isinstance(m, Linear) else 1
               for name, _ in model.named_parameters()
               for m in [model.get_submodule(name.rsplit(".", 1)[0])])


def _with_progress(weights: Weights, total: int, description: str) -> Weights:
    """A rich progress bar over the checkpoint's tensors as they are copied in."""
    from llmaccel.progress import progress_bar

    with progress_bar() as bar:
        task = bar.add_task(description, total=total)
        for item in weights:
            yield item
            bar.advance(task)


def safetensors_weights(directory: Path, device: torch.device) -> Weights:
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise CorruptCheckpointError(f"{index} is not a valid safetensors index: {e}") from e
        paths = [directory / f for f in files]
    else:
        paths = sorted(directory.glob("*.safetensors"))
    if not paths:
        hint = " (only PyTorch .bin weights: convert them to safetensors)" if any(
            directory.glob("*.bin")) else ""
        raise CorruptCheckpointError(f"no *.safetensors weights in '{directory}'{hint}")
    for path in paths:
        try:
            handle = safe_open(str(path), framework="pt", device=str(device))
        except Exception as e:
            raise CorruptCheckpointError(f"cannot read safetensors file '{path}' (corrupt or "
                                         f"truncated?): {e}") from e
        with handle:
            for name in handle.keys():
                try:
                    tensor = handle.get_tensor(name)
                except Exception as e:
                    raise CorruptCheckpointError(f"cannot read tensor '{name}' from '{path}' "
                                                 f"(corrupt or truncated?): {e}") from e
                yield name, tensor


def gguf_weights(mc: ModelConfig, device: torch.device) -> Weights:
    """Dequantized GGUF tensors with HF names, through transformers' GGUF utilities (which
    also undo llama.cpp's q/k row permutation)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from llmaccel.models.gguf_loading import fast_gguf, release_readers

    # transformers maps GGUF names to HF names by walking an HF model's state dict; a model
    # on the meta device gives the names without allocating anything.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(mc.hf_config)
    try:
        with fast_gguf():  # the config's metadata parse reused, our dequantization
            parsed = load_gguf_checkpoint(str(mc.source.path), return_tensors=True,
                                          model_to_load=skeleton, torch_dtype=mc.dtype)
    except Exception as e:
        raise CorruptCheckpointError(f"cannot read GGUF file '{mc.source.path}' (corrupt or "
                                     f"truncated?): {str(e).strip().splitlines()[0]}") from e
    finally:
        release_readers()
    tensors = parsed["tensors"]
    for name in list(tensors):
        yield name, tensors.pop(name).to(device)  # pop: drop each host copy once it is used


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = 0, std: float | None = None) -> None:
    """Random weights for speed work (vLLM's `load_format="dummy"`), generated on the model's
    device: uniform with the config's `initializer_range` as standard deviation, norms at 1.
    Not vLLM's +-1e-3: values that small drive activations into subnormal floats, which run
    several times slower on CPUs and would distort CPU measurements."""
    std = std or getattr(getattr(model, "config", None), "initializer_range", None) or 0.02
    bound = std * 3 ** 0.5
    for name, param in model.named_parameters():
        if param.is_meta:  # shape-only models (counting, planning) hold no values
            continue
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        gen = torch.Generator(device=param.device).manual_seed(
            seed * 1_000_003 + zlib.crc32(name.encode()))
        if param.is_floating_point() and param.element_size() == 1:
            # float8 has no uniform_: draw in fp32 and round (methods with a scale tensor
            # re-draw both in their init_dummy_weights hook)
            tmp = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            param.copy_(tmp.uniform_(-bound, bound, generator=gen))
        elif param.is_floating_point():
            param.uniform_(-bound, bound, generator=gen)
        else:  # packed integer weights of quantized layers
            param.random_(0, 256, generator=gen)
    for module in model.modules():  # index tensors (g_idx, shapes) that random values break
        hook = getattr(getattr(module, "quant_method", None), "init_dummy_weights", None)
        if hook is not None:
            hook(module)


def load_model(model: str | None, *, dtype: str | torch.dtype = "auto",
               device: str | torch.device | None = None, load_format: str = "auto",
               max_model_len: int | None = None, seed: int = 0, progress: bool = False,
               attention_backend: str = "auto"):
    """Convenience: (ModelConfig, model) for a path, hub id, GGUF file or shape name."""
    from llmaccel.models.config import make_model_config

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LLMAccelError("device 'cuda' was asked for but no CUDA GPU is available")
    mc = make_model_config(model, dtype=dtype, max_model_len=max_model_len,
                           load_format=load_format, device=device)
    return mc, get_model(mc, device, seed=seed, progress=progress,
                         attention_backend=attention_backend)
