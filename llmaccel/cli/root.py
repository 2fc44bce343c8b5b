"""The `llmaccel` command."""

from __future__ import annotations

import json
import sys
import time
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from llmaccel.cli import options as o
from llmaccel.version import __version__
from llmaccel.errors import LLMAccelError

app = typer.Typer(help="Analyze, compress, speed up, serve and measure causal LMs.",
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)
console = Console()
err_console = Console(stderr=True)

MODEL_HELP = o.MODEL_HELP


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
    min_p: float = typer.Option(0.0, min=0.0, max=1.0),
    n: int = typer.Option(1, min=1, help="Completions per prompt."),
    stop: list[str] = typer.Option([], help="Stop string; repeat for several."),
    ignore_eos: bool = typer.Option(False),
    seed: Optional[int] = typer.Option(None),
    dtype: str = o.DTYPE,
    device: Optional[str] = o.DEVICE,
    chat: Optional[bool] = typer.Option(None, "--chat/--raw", help="Wrap the prompt in the "
                                        "chat template (default: when the tokenizer has one)."),
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
) -> None:
    """Generate text for one or more prompts on the engine."""
    from llmaccel.engine import SamplingParams
    from llmaccel.engine.llm import LLM
    from llmaccel.models.tokenizer import format_prompt

    params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                            min_p=min_p, max_tokens=max_tokens, seed=seed, stop=stop or None,
                            ignore_eos=ignore_eos)
    kwargs = o.engine_kwargs(locals())
    start = time.perf_counter()
    with console.status("loading model…"):
        llm = LLM(model, **kwargs)
    load_s = time.perf_counter() - start
    tok = llm.get_tokenizer()
    if tok is None:
        raise LLMAccelError("this model has no tokenizer; pass --tokenizer")
    requests = [{"prompt": p, "prompt_token_ids": format_prompt(tok, p, chat)} for p in prompt]
    start = time.perf_counter()
    outs = llm.generate(requests, params)
    gen_s = time.perf_counter() - start
    for text, out in zip(prompt, outs):
        if out.error:
            raise LLMAccelError(f"prompt {text[:40]!r}: {out.error}")
        for completion in out.outputs:
            label = f" #{completion.index}" if n > 1 else ""
            console.rule(f"[dim]{text}{label}")
            console.print(completion.text, markup=False, highlight=False)
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    mc, stats = llm.engine.model_config, llm.get_stats()
    console.print(f"[dim]{mc.name} · {str(mc.dtype).removeprefix('torch.')} on "
                  f"{llm.engine.device} · load {load_s:.1f}s · {tokens} tokens in {gen_s:.2f}s "
                  f"({tokens / gen_s:.1f} tok/s) · prefix hit rate "
                  f"{stats.prefix_hit_rate:.0%} · {stats.num_preemptions} preemptions")
    if stats.spec_decode is not None:
        sd = stats.spec_decode
        console.print(f"[dim]speculative: acceptance {sd['acceptance_rate']:.0%} · "
                      f"{sd['mean_accepted_len']:.2f} tokens per verify step · "
                      f"{sd['num_draft_tokens']} drafts")


@app.command()
def quantize(
    model: Optional[str] = typer.Argument(None, help="A local HF directory, a GGUF file "
                                          "(dequantized to safetensors first) or a hub id "
                                          "(org/name); default: the default model."),
    method: str = typer.Option("gptq", help="rtn, gptq, awq, fp8 (W8A8: E4M3 weights, "
                               "per-token activation scales; no calibration), nf4 "
                               "(bitsandbytes 4-bit NormalFloat; no calibration) or hqq "
                               "(half-quadratic zero points; no calibration)."),
    bits: Optional[int] = typer.Option(None, help="4 or 8 (default 4; AWQ checkpoints: 4 "
                                       "only; fp8: 8)."),
    group_size: Optional[int] = typer.Option(None, help="Input channels per scale: 32, 64, "
                                             "128, or -1 for one per output channel "
                                             "(default 128; hqq: 64; nf4: the bitsandbytes "
                                             "blocksize, default 64; fp8: always per "
                                             "channel)."),
    sym: Optional[bool] = typer.Option(None, "--sym/--asym", help="Symmetric codes (default "
                                       "for rtn and gptq) or zero points (default for awq)."),
    fmt: Optional[str] = typer.Option(None, "--format", help="gptq, awq, compressed-tensors "
                                      "or bitsandbytes (default: gptq for gptq, awq for awq, "
                                      "bitsandbytes for nf4, compressed-tensors for rtn, hqq "
                                      "and fp8)."),
    data: str = typer.Option("wikitext2", "--data", "--calib", help=o.DATA_HELP + " GPTQ and "
                             "AWQ calibrate on its validation split; the other methods read "
                             "no text (a local copy feeds the per-layer error report)."),
    n_samples: Optional[int] = typer.Option(
        None, min=1, help="Calibration sequences (default 128; 16 for rtn, fp8, nf4 and hqq, "
        "which read them only for the per-layer error report)."),
    seq_len: int = typer.Option(512, min=2, help="Tokens per calibration sequence."),
    seed: int = typer.Option(0, help="Seed for picking calibration windows."),
    act_order: bool = typer.Option(False, help="GPTQ act-order (desc_act)."),
    sink_weight: Optional[float] = typer.Option(
        None, min=1.0, help="GPTQ: tokens each calibration sequence's first token (the "
        "attention sink) counts as in the Hessian (default seq_len / 64; 1 = plain GPTQ)."),
    lm_head: bool = typer.Option(False, "--lm-head", help="Quantize the LM head too (rtn or "
                                 "gptq in the gptq format: GPTQModel's and vLLM's lm_head: true)."),
    out: str = typer.Option(..., "--out", help="Output directory."),
    device: Optional[str] = typer.Option(None, help="cuda or cpu (default: cuda if present)."),
) -> None:
    """Quantize a model's linears (RTN, GPTQ, AWQ, FP8, NF4, HQQ) into a checkpoint
    vLLM/transformers load."""
    from llmaccel.quant.calibration import CalibConfig
    from llmaccel.quant.driver import default_n_samples, quantize_model

    if model is None:
        from llmaccel.models.default_model import default_model_path

        model = str(default_model_path())
    if n_samples is None:
        n_samples = default_n_samples(method)
    if model.endswith(".gguf"):
        console.print(f"{model} is a GGUF file: dequantizing it to a safetensors model first; "
                      f"the checkpoint in {out} is safetensors", highlight=False)
    report = quantize_model(model, method=method, bits=bits, group_size=group_size, sym=sym,
                            out_dir=out, calib=CalibConfig(data, n_samples, seq_len, seed),
                            format=fmt, device=device, act_order=act_order,
                            sink_weight=sink_weight, lm_head=lm_head)
    errs = report.layer_error
    summary = ""
    if errs and report.layer_error_rtn:
        summary = (f" · mean layer error {sum(errs) / len(errs):.3g} "
                   f"(RTN {sum(report.layer_error_rtn) / len(errs):.3g})")
    scheme = {"fp8": "fp8 W8A8", "nf4": "nf4"}.get(report.method, f"int{report.bits}")
    console.print(f"wrote {report.format} {scheme} checkpoint to {out} in "
                  f"{report.seconds:.1f}s{summary}", highlight=False)


@app.command()
def finetune(
    model: Optional[str] = typer.Argument(None, help="An HF directory, a hub id (org/name) or "
                                          "a GGUF file (dequantized by transformers); default: "
                                          "the default model."),
    data: str = typer.Option("wikitext2", help=o.DATA_HELP + " Trains on its validation split "
                             "(a dataset id: its train split)."),
    lora_r: int = typer.Option(8, min=1, help="LoRA rank r."),
    lora_alpha: float = typer.Option(16.0, help="LoRA alpha (the update is scaled by "
                                     "alpha / r)."),
    target_modules: str = typer.Option(",".join(("q_proj", "k_proj", "v_proj", "o_proj")),
                                       help="Comma-separated module names to adapt."),
    lr: float = typer.Option(1e-4, help="Learning rate (low by default: LoRA diverges fast)."),
    steps: int = typer.Option(200, min=1, help="Optimizer steps."),
    batch_size: int = typer.Option(4, min=1),
    seq_len: int = typer.Option(256, min=2, help="Tokens per training block."),
    eval_every: int = typer.Option(25, min=1, help="Steps between held-out evaluations."),
    patience: int = typer.Option(2, min=1, help="Evaluations without a new best before "
                                 "stopping."),
    max_blocks: Optional[int] = typer.Option(None, min=2, help="Use at most this many blocks "
                                             "of the data."),
    seed: int = typer.Option(0),
    out: str = typer.Option(..., "--out", help="Output directory (adapter/, merged/, "
                            "finetune.json)."),
    device: Optional[str] = typer.Option(None, help="cuda or cpu (default: cuda if present)."),
    dtype: str = typer.Option("auto", help="auto (bf16 on a GPU, fp32 on the CPU), bfloat16, "
                              "float16 or float32."),
) -> None:
    """LoRA fine-tuning (peft) with held-out perplexity, early stopping on a rising
    perplexity or degenerate probe generations, and a merged HF model."""
    from llmaccel.train.lora import FinetuneConfig
    from llmaccel.train.lora import finetune as run_finetune

    if model is None:
        from llmaccel.models.default_model import default_model_path

        model = str(default_model_path())
    targets = tuple(t.strip() for t in target_modules.split(",") if t.strip())
    res = run_finetune(FinetuneConfig(
        model=model, out=out, data=data, lora_r=lora_r, lora_alpha=lora_alpha,
        target_modules=targets, lr=lr, steps=steps, batch_size=batch_size, seq_len=seq_len,
        eval_every=eval_every, patience=patience, max_blocks=max_blocks, seed=seed,
        device=device, dtype=dtype))
    why = f"; stopped early: {res.stopped}" if res.stopped else ""
    console.print(f"held-out perplexity {res.baseline_ppl:.3f} -> {res.best_ppl:.3f} (best at "
                  f"step {res.best_step} of {res.steps_run}{why}); wrote {out}/merged, "
                  f"{out}/adapter and {out}/finetune.json", highlight=False)


from llmaccel.cli.distill_draft import distill_draft  # noqa: E402 - next to its registration

app.command("distill-draft")(distill_draft)


from llmaccel.bench.command import bench_app  # noqa: E402 - next to its registration
from llmaccel.cli.report import report  # noqa: E402

app.add_typer(bench_app, name="bench")
app.command("report")(report)

eval_app = typer.Typer(help="Measure model quality: perplexity, functional code accuracy "
                        "(pass@k), lm-evaluation-harness tasks.", no_args_is_help=True)
app.add_typer(eval_app, name="eval")


@eval_app.command("ppl")
def eval_ppl(
    model: Optional[str] = typer.Argument(None, help=MODEL_HELP),
    data: str = typer.Option("wikitext2", help=o.DATA_HELP + " Measured on its test split."),
    join: str = typer.Option("hf", help="WikiText rows: hf (joined with a blank line, the "
                             "usual recipe) or raw (the file as is)."),
    context: int = typer.Option(2048, min=2, help="Tokens per window."),
    stride: Optional[int] = typer.Option(None, min=1, help="Tokens between window starts "
                                         "(default: the context, no overlap)."),
    limit: Optional[int] = typer.Option(None, min=1, help="At most this many windows (a "
                                        "quick partial figure)."),
    dtype: str = o.DTYPE,
    device: Optional[str] = o.DEVICE,
    tokenizer: Optional[str] = o.TOKENIZER,
    backend: str = typer.Option("llmaccel", help="llmaccel (our engine's model) or hf "
                                "(transformers' AutoModelForCausalLM and its own loss, over the "
                                "same windows and token ids: an independent check)."),
    quantization: Optional[str] = typer.Option(
        None, help="Quantize the model first by a scheme (rtn-int8, "
        "rtn-int4-g128, nf4, hqq-int4, gptq-int4-g128, awq-int4-g128, fp8; GPTQ/AWQ calibrate "
        "on the validation split of --data), as `llmaccel quantize` does, and measure the "
        "result."),
    quantized_dir: Optional[str] = o.QUANTIZED_DIR,
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Perplexity by the sliding-window method, through our engine's model: any checkpoint
    format the engine loads (GPTQ, AWQ, compressed-tensors, NF4, FP8) or a plain model; or,
    with --backend hf, through transformers on the same windows."""
    from llmaccel.eval.perplexity import evaluate_perplexity

    res = evaluate_perplexity(model, data=data, joining=join, context=context, stride=stride,
                              limit=limit, dtype=dtype, device=device, tokenizer=tokenizer,
                              progress=not as_json, backend=backend,
                              quantization=quantization, quantized_dir=quantized_dir)
    if as_json:
        print(json.dumps({"model": model, **res.to_dict()}))
        return
    console.print(f"perplexity {res.ppl:.4f} (nll {res.nll:.4f}) over {res.scored_tokens:,} "
                  f"scored of {res.total_tokens:,} tokens; {res.windows} windows, context "
                  f"{res.context}, stride {res.stride}, data {res.data} (rows joined: "
                  f"{res.joining}); backend {res.backend}"
                  + (f"; quantization {res.quantization} ({res.quantization_config})"
                     if res.quantization else "")
                  + f"; {res.seconds:.1f}s", highlight=False)


from llmaccel.cli.eval_code import eval_code  # noqa: E402 - next to its registration
from llmaccel.cli.eval_lm_eval import eval_lm_eval  # noqa: E402

eval_app.command("code")(eval_code)
eval_app.command("lm-eval")(eval_lm_eval)

from llmaccel.cli.serve import serve  # noqa: E402 - next to its registration

app.command("serve")(serve)

from llmaccel import envs
from llmaccel.cli.run import run  # noqa: E402 - next to its registration

app.command("run")(run)


def main() -> None:
    """Entry point: user errors print one line and exit 1, without a traceback."""
    from llmaccel.progress import quiet_library_progress

    quiet_library_progress()
    try:
        app()
    except LLMAccelError as e:
        # one line however long: scripts and tests read the error as the last line
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", markup=True,
                          highlight=False, soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
    except Exception as e:  # a bug: say so in one line; LLMACCEL_DEBUG=1 shows the traceback
        if envs.LLMACCEL_DEBUG:
            raise
        err_console.print(f"[bold red]internal error:[/] {type(e).__name__}: {e} "
                          "(set LLMACCEL_DEBUG=1 for the traceback)", highlight=False,
                          soft_wrap=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
