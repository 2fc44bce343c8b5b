"""`llmaccel bench spec` (W5): speculative decoding against plain decoding on our engine, same
process, same requests, timed runs alternating between the two engines (drift in clocks or
the host falls on both alike).

Per batch size and prompt kind (code / prose, `spec_prompts.py`): `batch` chat-formatted
requests at once, greedy, EOS ignored; out_tok_s of both, `speedup` = plain wall / spec
wall (medians of the repeats), acceptance rate, mean accepted length and acceptance per
draft position from the engine's counters over the timed spec runs only, and whether the
greedy tokens equal plain decoding's (speculation must be lossless).

Both engines run through the offline API (`LLM.generate`: add every request, step until
done), as vLLM's offline speculative-decoding benchmarks do. W5 measures the engine's decode
speedup; through AsyncLLM (one thread hop and one streamed output per request per step,
incremental detokenization) the same H100 cells were 5-15% slower at batch 4-64 and varied by
up to 25% between repeats, which swamped speedups near 1 (the Qwen study's first W5 runs).
W3 measures the server.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from llmaccel.bench.results import Record, RunMeta, make_record
from llmaccel.bench.spec_prompts import PROMPTS


@dataclass(frozen=True)
class SpecSettings:
    batches: tuple[int, ...] = (1, 4, 16, 64)
    kinds: tuple[str, ...] = ("code", "prose")
    max_tokens: int = 192
    repeats: int = 3


def chat_prompts(llm: Any, kind: str, batch: int) -> list[list[int]]:
    """`batch` chat-formatted prompts (token ids) cycling through the kind's prompts."""
    from llmaccel.models.tokenizer import format_prompt

    tok = llm.get_tokenizer()
    if tok is None:
        raise ValueError("W5 needs the model's tokenizer (real prompts, real acceptance)")
    base = PROMPTS[kind]
    return [format_prompt(tok, base[i % len(base)], None) for i in range(batch)]


def _spec_counts(llm: Any) -> dict[str, Any]:
    spec = llm.engine.spec
    if spec is None:
        raise ValueError("the speculative engine has no speculation configured")
    d = spec.stats.as_dict()
    return {k: (list(v) if isinstance(v, list) else v) for k, v in d.items()}


def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """Counters of the timed runs alone: after - before (lists by position)."""
    out: dict[str, Any] = {}
    for key in ("num_steps", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens",
                "num_off_steps"):
        out[key] = after[key] - before[key]
    for key in ("accepted_per_position", "drafted_per_position"):
        a, b = after[key], before[key]
        out[key] = [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]
    drafted = out["num_draft_tokens"]
    out["acceptance_rate"] = out["num_accepted_tokens"] / drafted if drafted else 0.0
    out["mean_accepted_len"] = (out["num_emitted_tokens"] / out["num_steps"]
                                if out["num_steps"] else 0.0)
    out["per_position_acceptance"] = [
        round(a / d, 4) if d else 0.0
        for a, d in zip(out["accepted_per_position"], out["drafted_per_position"])]
    return out


def _one(llm: Any, prompts: list[list[int]], params: Any, label: str
         ) -> tuple[float, list[list[int]], int]:
    """One timed run: wall seconds, every request's tokens, tokens generated."""
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    bad = [o.error for o in outs if o.error]
    if bad:
        raise RuntimeError(f"{label}: {bad[0]}")
    ids = [list(o.outputs[0].token_ids) for o in outs]
    return wall, ids, sum(len(t) for t in ids)


def spec_cells(plain: Any, spec: Any, method: str, spec_config: dict[str, Any],
               settings: SpecSettings, meta: RunMeta, model: str,
               progress: Any = None) -> list[Record]:
    """Every (kind, batch) cell for one speculative engine (an `LLM`) against the plain one.
    `progress`: a callable told each finished cell's one-line summary."""
    from llmaccel.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=settings.max_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    records: list[Record] = []
    for kind in settings.kinds:
        for batch in settings.batches:
            prompts = chat_prompts(plain, kind, batch)
            for llm in (plain, spec):  # compile / capture this batch's shapes untimed
                _one(llm, prompts, warm, "warm-up")
            walls: dict[str, list[float]] = {"plain": [], "spec": []}
            ids: dict[str, list[list[int]]] = {}
            tokens: dict[str, int] = {}
            before = _spec_counts(spec)
            for i in range(settings.repeats):
                for name, llm in (("plain", plain), ("spec", spec)):
                    wall, ids[name], tokens[name] = _one(
                        llm, prompts, params, f"W5 {kind} b{batch} {name} {i + 1}")
                    walls[name].append(wall)
            counts = _delta(_spec_counts(spec), before)
            plain_wall, spec_wall = (statistics.median(walls[n]) for n in ("plain", "spec"))
            config = {"method": method, "batch": batch, "kind": kind,
                      "speculative_config": spec_config, "max_tokens": settings.max_tokens,
                      "plain_out_tok_s": round(tokens["plain"] / plain_wall, 3),
                      "spec_out_tok_s": round(tokens["spec"] / spec_wall, 3),
                      "walls_plain_ms": [round(w * 1e3, 2) for w in walls["plain"]],
                      "walls_spec_ms": [round(w * 1e3, 2) for w in walls["spec"]],
                      "identical_to_plain": ids["plain"] == ids["spec"],
                      "per_position_acceptance": counts["per_position_acceptance"],
                      "spec_counters": {k: v for k, v in counts.items()
                                        if k != "per_position_acceptance"},
                      "timing": "offline LLM.generate, alternating plain/spec repeats, "
                                "median wall each"}
            for metric, value in (("speedup", plain_wall / spec_wall),
                                  ("acceptance_rate", counts["acceptance_rate"]),
                                  ("mean_accepted_len", counts["mean_accepted_len"]),
                                  ("out_tok_s", tokens["spec"] / spec_wall)):
                records.append(make_record(meta, "W5", model, "llmaccel", config, metric,
                                           value,
                                           load_format=plain.engine.model_config.load_format))
            if progress is not None:
                progress(f"W5 {method} {kind} b{batch}: plain {plain_wall * 1e3:.0f} ms, "
                         f"spec {spec_wall * 1e3:.0f} ms, {plain_wall / spec_wall:.3f}x, "
                         f"acceptance {counts['acceptance_rate']:.2f}")
    return records


__all__ = ["SpecSettings", "chat_prompts", "spec_cells"]
