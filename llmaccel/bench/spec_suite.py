"""`llmaccel bench spec` (W5): speculative decoding against plain decoding on our engine, same
process, same requests, timed runs alternating between the two engines (drift in clocks or
the host falls on both alike).

Per batch size and prompt kind (code / prose, `spec_prompts.py`): `batch` chat-formatted
requests at once, greedy, EOS ignored; out_tok_s of both, `speedup` = plain wall / spec
wall (medians of the repeats), acceptance rate, mean accepted length and acceptance per
draft position from the engine's counters over the timed spec runs only, and whether the
greedy tokens equal plain decoding's (speculation must be lossless).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from llmaccel.bench.backends.base import BenchRequest
from llmaccel.bench.backends.engine import EngineBackend
from llmaccel.bench.load import LoadPoint, run_load
from llmaccel.bench.results import Record, RunMeta, make_record
from llmaccel.bench.spec_prompts import PROMPTS


@dataclass(frozen=True)
class SpecSettings:
    batches: tuple[int, ...] = (1, 4, 16, 64)
    kinds: tuple[str, ...] = ("code", "prose")
    max_tokens: int = 192
    repeats: int = 3
    progress: bool = True


def chat_requests(engine_backend: EngineBackend, kind: str, batch: int,
                  max_tokens: int) -> list[BenchRequest]:
    from llmaccel.models.tokenizer import format_prompt

    tok = engine_backend.engine.tokenizer
    if tok is None:
        raise ValueError("W5 needs the model's tokenizer (real prompts, real acceptance)")
    base = PROMPTS[kind]
    ids = [format_prompt(tok, base[i % len(base)], None) for i in range(batch)]
    return [BenchRequest(p, len(p), max_tokens) for p in ids]


def _spec_counts(backend: EngineBackend) -> dict[str, Any]:
    spec = backend.engine.spec
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


async def _one(backend: EngineBackend, requests: list[BenchRequest], progress: bool,
               label: str) -> tuple[float, list[str], int]:
    results, wall = await run_load(backend, requests, LoadPoint(), description=label,
                                   progress=progress)
    bad = [r.error for r in results if not r.success]
    if bad:
        raise RuntimeError(f"{backend.name} {label}: {bad[0]}")
    return wall, [r.generated_text for r in results], sum(r.output_len for r in results)


async def spec_cells(plain: EngineBackend, spec: EngineBackend, method: str,
                     spec_config: dict[str, Any], settings: SpecSettings, meta: RunMeta,
                     model: str) -> list[Record]:
    """Every (kind, batch) cell for one speculative engine against the plain one."""
    records: list[Record] = []
    for kind in settings.kinds:
        for batch in settings.batches:
            requests = chat_requests(plain, kind, batch, settings.max_tokens)
            warm = [BenchRequest(r.prompt, r.prompt_len, 8) for r in requests]
            for b in (plain, spec):  # compile / capture this batch's shapes untimed
                await _one(b, warm, False, "warm-up")
            walls: dict[str, list[float]] = {"plain": [], "spec": []}
            texts: dict[str, list[str]] = {}
            tokens: dict[str, int] = {}
            before = _spec_counts(spec)
            for i in range(settings.repeats):
                for name, b in (("plain", plain), ("spec", spec)):
                    wall, texts[name], tokens[name] = await _one(
                        b, requests, settings.progress, f"W5 {kind} b{batch} {name} {i + 1}")
                    walls[name].append(wall)
            counts = _delta(_spec_counts(spec), before)
            plain_wall, spec_wall = (statistics.median(walls[n]) for n in ("plain", "spec"))
            config = {"method": method, "batch": batch, "kind": kind,
                      "speculative_config": spec_config, "max_tokens": settings.max_tokens,
                      "plain_out_tok_s": round(tokens["plain"] / plain_wall, 3),
                      "spec_out_tok_s": round(tokens["spec"] / spec_wall, 3),
                      "walls_plain_ms": [round(w * 1e3, 2) for w in walls["plain"]],
                      "walls_spec_ms": [round(w * 1e3, 2) for w in walls["spec"]],
                      "identical_to_plain": texts["plain"] == texts["spec"],
                      "per_position_acceptance": counts["per_position_acceptance"],
                      "spec_counters": {k: v for k, v in counts.items()
                                        if k != "per_position_acceptance"},
                      "timing": "alternating plain/spec repeats, median wall each"}
            for metric, value in (("speedup", plain_wall / spec_wall),
                                  ("acceptance_rate", counts["acceptance_rate"]),
                                  ("mean_accepted_len", counts["mean_accepted_len"]),
                                  ("out_tok_s", tokens["spec"] / spec_wall)):
                records.append(make_record(meta, "W5", model, "llmaccel", config, metric,
                                           value, load_format=plain.load_format))
    return records


__all__ = ["SpecSettings", "chat_requests", "spec_cells"]
