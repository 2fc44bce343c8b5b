"""lm-evaluation-harness tasks through our engine (the LM of eval/lm_eval_bridge.py), as
`llmaccel eval lm-eval` runs them (cli/eval_lm_eval.py); lm_eval itself is imported only when
a run starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from llmaccel.errors import LLMAccelError

def parse_tasks(tasks: str) -> list[str]:
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        raise LLMAccelError("name at least one task (--tasks hellaswag,arc_easy)")
    return names


def run_lm_eval(model: Optional[str], tasks: list[str], *, num_fewshot: Optional[int] = None,
                limit: Optional[float] = None, batch_size: int = 16,
                dtype: str = "auto", device: Optional[str] = None,
                max_length: Optional[int] = None, include_path: Optional[str] = None,
                tokenizer: Optional[str] = None, apply_chat_template: bool = False,
                bootstrap_iters: int = 100_000, log_samples: bool = False, seed: int = 0,
                confirm_run_unsafe_code: bool = False, **lm_kwargs: Any) -> dict[str, Any]:
    """lm_eval.simple_evaluate over our engine; lm_eval's results dict."""
    from llmaccel.eval.lm_eval_bridge import lm_eval_model_class, require_lm_eval

    lm_eval = require_lm_eval()
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).exists():
        raise LLMAccelError(f"--include-path {include_path} does not exist")
    manager = None
    if include_path is not None:
        # Tasks all found in include_path: skip indexing lm-eval's own task folders (~10 s).
        manager = TaskManager(include_path=include_path, include_defaults=False)
        if any(not manager.match_tasks([t]) for t in tasks):
            manager = None
    if manager is None:
        manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        raise LLMAccelError(f"unknown lm-eval task(s): {', '.join(unknown)} (see `lm-eval ls "
                            "tasks`, or --include-path for a folder of task YAMLs)")
    lm = lm_eval_model_class()(pretrained=model, dtype=dtype, device=device,
                               batch_size=batch_size, max_length=max_length,
                               tokenizer=tokenizer, **lm_kwargs)
    results = lm_eval.simple_evaluate(
        model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit, batch_size=batch_size,
        task_manager=manager, apply_chat_template=apply_chat_template,
        bootstrap_iters=bootstrap_iters, log_samples=log_samples, random_seed=seed,
        numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
        confirm_run_unsafe_code=confirm_run_unsafe_code)
    if results is None:  # only non-zero ranks of a distributed run get None
        raise LLMAccelError("lm-eval returned no results")
    return results


__all__ = ["parse_tasks", "run_lm_eval"]
