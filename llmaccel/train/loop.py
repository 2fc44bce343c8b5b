"""What every trainer in train/ shares: loading an HF causal LM to train on (a directory, a hub
id, or a GGUF file dequantized to a plain HF directory), and the optimization loop with
held-out evaluations, early stopping and the best weights restored.

The loop stops when the held-out metric has not improved for `patience` evaluations, when the
loss is not finite, when a caller's check rejects an evaluation (LoRA: probe generations
turned degenerate), or when a time limit is reached (evaluated and kept like a last step, so a
run bounded by a wall clock still saves its best weights). A rejected evaluation never
becomes the best, so the weights restored at the end are always ones that passed every check.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from llmaccel.errors import LLMAccelError

# Training steps between reads of their losses (each read waits for the GPU).
READ_EVERY = 25

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device_dtype(device: str | None, dtype: str) -> tuple[torch.device, torch.dtype]:
    """`device` (None: cuda if present) and `dtype` ('auto': bf16 on a GPU, fp32 on the CPU)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    names = {"auto": torch.bfloat16 if dev.type == "cuda" else torch.float32, **DTYPES}
    if dtype not in names:
        raise LLMAccelError(f"dtype must be one of {', '.join(names)}, got {dtype!r}")
    return dev, names[dtype]


def load_causal_lm(model: str, device: torch.device, dtype: torch.dtype):
    """(transformers model, tokenizer or None) for `model`, on `device` in `dtype`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmaccel.models.source import resolve_model_source

    source = resolve_model_source(model)
    if source.kind == "shape":
        raise LLMAccelError(f"{model!r} is a benchmark shape with random weights; training "
                            "needs a real model (HF directory, hub id or GGUF)")
    if source.kind == "gguf":
        # transformers marks a GGUF-loaded model as quantized and refuses to save it (a
        # merged model, a student): train on the dequantized weights as a plain HF directory.
        import shutil
        import tempfile

        from llmaccel.models.convert import gguf_to_hf_dir

        tmp = tempfile.mkdtemp(prefix="llmaccel-train-base-")
        try:
            _, tokenizer = gguf_to_hf_dir(source.path, tmp, return_model=False)
            net = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(device)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return net, tokenizer
    net = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype).to(device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.path)
    except Exception:  # no tokenizer files: fine when token blocks are passed in
        tokenizer = None
    if tokenizer is not None and len(tokenizer) == 0:
        tokenizer = None  # transformers 5 builds an empty one for a directory without files
    return net, tokenizer


@dataclass
class LoopOutcome:
    history: list[dict[str, Any]]
    best_step: int
    steps_run: int
    stopped: str | None


def train_with_early_stop(
        *, params: list[torch.nn.Parameter], lr: float, steps: int, batch_size: int,
        eval_every: int, patience: int, seed: int, train: torch.Tensor, device: torch.device,
        step_loss: Callable[[torch.Tensor], torch.Tensor],
        evaluate: Callable[[], dict[str, Any]], metric: str, metric_name: str,
        describe: Callable[[float], str], snapshot: Callable[[], Any],
        restore: Callable[[Any], None], label: str, status: Callable[[dict[str, Any]], str],
        check: Callable[[dict[str, Any], dict[str, Any]], str | None] | None = None,
        progress: bool = True, schedule: str = "constant", warmup: int = 0,
        max_seconds: float | None = None) -> LoopOutcome:
    """AdamW on `params` over random batches of `train` ([n, seq_len] token blocks).
    `evaluate()` returns the held-out measures, `metric` among them (lower is better; shown
    in messages as `metric_name` = `describe(value)`); every `eval_every` steps and at the
    last step a history row {step, train_loss, **measures, seconds} is recorded, `status(row)`
    updates the progress bar, and `check(row, first_row)` may reject it with a reason.
    `schedule`: constant, or cosine (lr decays to a tenth over `steps`), either after `warmup`
    linear warm-up steps. `max_seconds`: evaluate and stop once training has run that long;
    the cosine then runs over whichever budget is used up first, steps or seconds, so a run
    cut by the time limit still ends at a tenth of the rate (a 1.5B head's run stopped at
    83% of its steps, its rate still at a quarter of the peak)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from llmaccel.progress import interactive

    if schedule not in ("constant", "cosine"):
        raise LLMAccelError(f"schedule must be constant or cosine, got {schedule!r}")
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)

    def lr_at(step: int) -> float:
        if step <= warmup:
            return lr * step / (warmup + 1)
        if schedule == "constant":
            return lr
        done = (step - warmup) / max(steps - warmup, 1)
        if max_seconds is not None:
            done = max(done, (time.perf_counter() - t0) / max_seconds)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(done, 1.0))))
    gen = torch.Generator().manual_seed(seed)
    history: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    def record(step: int, train_loss: float | None) -> dict[str, Any]:
        start = time.perf_counter()
        measures = evaluate()
        now = time.perf_counter()
        # eval_seconds: this evaluation's share of `seconds` (the wall since the start)
        row = {"step": step, "train_loss": train_loss, **measures,
               "seconds": round(now - t0, 2), "eval_seconds": round(now - start, 2)}
        history.append(row)
        return row

    first = record(0, None)
    best, best_step, best_state = first[metric], 0, snapshot()
    stopped, bad, losses, step = None, 0, [], 0
    pending: list[torch.Tensor] = []  # this stretch's losses, still on the device
    bar = Progress(TextColumn(label), BarColumn(), TextColumn(
        "{task.completed}/{task.total} loss {task.fields[loss]:.3f} {task.fields[status]}"),
        TimeRemainingColumn(), disable=not (progress and interactive()))
    task = bar.add_task("train", total=steps, loss=float("nan"), status=status(first))
    bar.start()
    try:
        for step in range(1, steps + 1):
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            idx = torch.randint(len(train), (batch_size,), generator=gen)
            loss = step_loss(train[idx].to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            pending.append(loss.detach())
            out_of_time = (max_seconds is not None
                           and time.perf_counter() - t0 >= max_seconds)
            evaluate_now = not (step % eval_every and step != steps and not out_of_time)
            if not evaluate_now and step % READ_EVERY:
                continue
            # The losses are read back (a host sync) only every READ_EVERY steps and before an
            # evaluation, so the host queues steps while the GPU runs earlier ones. A
            # non-finite loss is found up to READ_EVERY steps late; the steps after it
            # trained on garbage, but they never reach an evaluation: the loop stops here and
            # restores the best evaluated weights.
            values = torch.stack(pending).tolist()
            first_step, pending = step - len(values) + 1, []
            bad_at = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
            if bad_at is not None:
                stopped = f"the training loss is not finite at step {first_step + bad_at}"
                break
            losses.extend(values)
            bar.update(task, completed=step, loss=values[-1])
            if not evaluate_now:
                continue
            row = record(step, sum(losses) / len(losses))
            losses = []
            bar.update(task, loss=row["train_loss"], status=status(row))
            stopped = check(row, first) if check is not None else None
            if stopped:
                break
            if row[metric] < best:
                best, best_step, best_state, bad = row[metric], step, snapshot(), 0
            else:
                bad += 1
            if bad >= patience:
                stopped = (f"held-out {metric_name} did not improve for {bad} evaluations "
                           f"(best {describe(best)} at step {best_step})")
                break
            if out_of_time:
                stopped = f"the time limit of {max_seconds:g} s was reached at step {step}"
                break
    finally:
        bar.stop()
    restore(best_state)  # the best evaluation's weights (maybe the untrained ones)
    return LoopOutcome(history, best_step, step, stopped)
