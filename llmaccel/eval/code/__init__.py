"""Functional code accuracy (`llmaccel eval code`): our own Python problems in HumanEval's
layout (problems.py, problems.jsonl), a sandbox that runs each generated program in its own
limited process (sandbox.py), and the runner: prompting, extracting the program, pass@k,
variants, records (runner.py). The `llmaccel eval code` command is cli/eval_code.py."""

from llmaccel.eval.code.problems import Problem, load_problems
from llmaccel.eval.code.runner import (GenerationSettings, VariantResult, evaluate, pass_at_k,
                                       run_code_eval)
from llmaccel.eval.code.sandbox import SandboxLimits, SandboxResult, run_program, run_programs

__all__ = ["GenerationSettings", "Problem", "SandboxLimits", "SandboxResult", "VariantResult",
           "evaluate", "load_problems", "pass_at_k", "run_code_eval", "run_program",
           "run_programs"]
