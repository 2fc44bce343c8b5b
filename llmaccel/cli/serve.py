"""`llmaccel serve MODEL`: the OpenAI-compatible server (FastAPI + uvicorn over AsyncLLM).
cli.py registers `serve` as `app.command("serve")`. Engine options mirror `llmaccel generate`."""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from llmaccel.cli import options as o
from llmaccel.errors import LLMAccelError
from llmaccel.server.settings import DEFAULT_MAX_BODY_BYTES

console = Console(stderr=True)


def serve(
    model: Optional[str] = typer.Argument(None, help=o.MODEL_HELP),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0: all)."),
    port: int = typer.Option(8000, min=0, max=65535),
    api_key: Optional[str] = typer.Option(None, envvar="LLMACCEL_API_KEY", help="Require "
                                          "'Authorization: Bearer KEY' on /v1/* (also from "
                                          "$LLMACCEL_API_KEY)."),
    served_model_name: list[str] = typer.Option([], help="Name clients pass as `model` "
                                                "(repeat for aliases; default: MODEL)."),
    max_waiting: Optional[int] = typer.Option(None, min=0, help="Admission control: past "
                                              "this many requests not yet started, answer "
                                              "503 with Retry-After (default: no limit)."),
    shutdown_timeout: float = typer.Option(30.0, min=0.0, help="On SIGTERM/SIGINT, seconds "
                                           "in-flight requests get to finish before they are "
                                           "aborted."),
    chat_template: Optional[str] = typer.Option(None, help="A Jinja chat template (a file or "
                                                "the text) instead of the tokenizer's."),
    allowed_origins: list[str] = typer.Option([], help="Browser origins allowed to call "
                                              "the API (CORS), e.g. https://app.example.com; "
                                              "repeat, or a JSON list as vLLM takes it "
                                              "('[\"*\"]'). Default: none."),
    max_request_body_bytes: int = typer.Option(
        DEFAULT_MAX_BODY_BYTES, min=1, help="Read a request body no further than this; past "
        "it answer 413."),
    log_level: str = typer.Option("info", help="debug, info, warning or error."),
    quantization: Optional[str] = typer.Option(
        None, help="Serve the model quantized by a scheme of docs/workloads.md (rtn-int8, "
        "rtn-int4-g128, nf4, hqq-int4, gptq-int4-g128, awq-int4-g128, fp8): quantized first, "
        "as `llmaccel quantize` does (GPTQ/AWQ calibrate on WikiText-2); with --load-format "
        "dummy, random codes of that format. A checkpoint already quantized (GPTQ, AWQ, "
        "compressed-tensors, FP8, NF4) needs no flag: its config.json says how."),
    quantized_dir: Optional[str] = o.QUANTIZED_DIR,
    dtype: str = o.DTYPE,
    device: Optional[str] = o.DEVICE,
    tokenizer: Optional[str] = o.TOKENIZER,
    max_model_len: Optional[int] = o.MAX_MODEL_LEN,
    load_format: str = o.LOAD_FORMAT,
    enable_prefix_caching: bool = o.ENABLE_PREFIX_CACHING,
    max_num_seqs: int = o.MAX_NUM_SEQS,
    max_num_batched_tokens: Optional[int] = o.MAX_NUM_BATCHED_TOKENS,
    num_gpu_blocks: Optional[int] = o.NUM_GPU_BLOCKS,
    gpu_memory_utilization: float = o.GPU_MEMORY_UTILIZATION,
    attention_backend: str = o.ATTENTION_BACKEND,
    enforce_eager: bool = o.ENFORCE_EAGER,
    kv_cache_dtype: str = o.KV_CACHE_DTYPE,
    cudagraph_capture_sizes: Optional[str] = o.CUDAGRAPH_CAPTURE_SIZES,
    async_scheduling: bool = o.ASYNC_SCHEDULING,
    speculative_config: Optional[str] = o.SPECULATIVE_CONFIG,
    seed: int = typer.Option(0, help="Seed for random (dummy) weights."),
) -> None:
    """Serve a model over the OpenAI API: /v1/completions, /v1/chat/completions (streaming
    too), /v1/models, /health, /metrics (Prometheus)."""
    # imported here: cli imports this module, and these pull in the model stack
    from llmaccel.engine.async_llm import AsyncLLM
    try:
        from llmaccel.server.app import build_app
        from llmaccel.server.runner import make_server
    except ImportError as e:
        raise LLMAccelError(f"llmaccel serve needs the server extra ({e.name} is missing): "
                            "pip install 'llmaccel[server]'") from None
    from llmaccel.server.settings import ServerSettings

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    kwargs = o.engine_kwargs(locals())
    template = _read_template(chat_template)
    with contextlib.ExitStack() as stack:
        path, overrides = _prepare_model(model, quantization, quantized_dir, load_format,
                                         device, stack)
        with console.status("loading model…"):
            engine = AsyncLLM.from_config(path, hf_overrides=overrides, seed=seed, **kwargs)
        mc = engine.engine.model_config
        names = tuple(served_model_name) or (model or mc.name,)
        settings = ServerSettings(served_model_names=names, model_root=str(model or mc.name),
                                  api_key=api_key, max_waiting=max_waiting,
                                  chat_template=template, shutdown_timeout_s=shutdown_timeout,
                                  allowed_origins=parse_origins(allowed_origins),
                                  max_request_body_bytes=max_request_body_bytes)
        server = make_server(build_app(engine, settings), host, port, log_level)
        console.print(f"serving {names[0]} ({mc.name}, max_model_len {mc.max_model_len}) on "
                      f"http://{host}:{port}/v1", highlight=False)
        server.run()


def parse_origins(values: list[str]) -> tuple[str, ...]:
    """--allowed-origins values: plain origins, or JSON lists of them (vLLM's form)."""
    out: list[str] = []
    for v in values:
        if v.strip().startswith("["):
            try:
                items = json.loads(v)
            except ValueError as e:
                raise LLMAccelError(f"--allowed-origins {v!r} is not a JSON list: {e}") from None
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise LLMAccelError(f"--allowed-origins {v!r}: a JSON list of strings")
            out += items
        else:
            out.append(v.strip())
    return tuple(o for o in out if o)


def _read_template(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value)
    if path.suffix in (".jinja", ".j2", ".txt") or path.is_file():
        if not path.is_file():
            raise LLMAccelError(f"chat template file not found: {value}")
        return path.read_text()
    return value


def _prepare_model(model: str | None, scheme: str | None, quantized_dir: str | None,
                   load_format: str, device: str | None, stack: contextlib.ExitStack
                   ) -> tuple[str | None, dict[str, Any] | None]:
    """(model to load, hf_overrides): the model as given, or quantized by `scheme` first."""
    if scheme is None:
        return model, None
    if load_format == "dummy":  # random codes in the scheme's layout, for speed work
        from llmaccel.quant.presets import preset_config

        return model, {"quantization_config": preset_config(scheme)}
    from llmaccel.quant.schemes import check_scheme, hf_source, quantize_scheme

    check_scheme(scheme)  # an unknown name fails before any work
    if model is None:
        from llmaccel.models.default_model import default_model_path

        model = str(default_model_path())
    work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="llmaccel-serve-")))
    src = hf_source(model, work)
    if (src / "config.json").is_file() and '"quantization_config"' in (
            src / "config.json").read_text():
        raise LLMAccelError(f"'{model}' is already quantized (its config.json has a "
                            "quantization_config); serve it without --quantization")
    out = Path(quantized_dir) if quantized_dir else work / scheme
    with console.status(f"quantizing ({scheme})…"):
        done = quantize_scheme(src, scheme, out, device=device)
    console.print(f"quantized {model} -> {done.path} ({done.config})", highlight=False)
    return str(done.path), None
