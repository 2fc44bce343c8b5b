"""`llmaccel report`: result files -> report.md tables with computed ratios + PNG plots.
Synthetic records of every workload with hand-computed numbers, each plot function alone,
user errors naming file and line, and two real committed result files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from llmaccel.bench import plots
from llmaccel.bench.report import (
    assign_rows,
    join_ppl_speed,
    load_runs,
    pareto_front,
    read_results,
    write_report,
)
from llmaccel.cli.report import report
from llmaccel.bench.results import Record
from llmaccel.errors import LLMAccelError

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DEVICE = "NVIDIA H100 80GB HBM3"


def rec(workload: str, backend: str, metric: str, value: float, model: str = "llama-3.2-1b",
        command: str = "python bench.py", **config: Any) -> dict[str, Any]:
    return {"workload": workload, "model": model, "load_format": "dummy", "backend": backend,
            "config": config, "metric": metric, "value": value, "device": DEVICE,
            "torch": "2.11.0", "commit": "abc1234", "command": command}


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def records(rows: list[dict[str, Any]]) -> list[Record]:
    return [Record.from_dict(r) for r in rows]


def assert_png(path: Path | None) -> None:
    assert path is not None and path.is_file()
    assert path.read_bytes()[:8] == PNG_MAGIC


# -- synthetic runs, one per workload -----------------------------------------------------------
def w3_rows() -> list[dict[str, Any]]:
    """llmaccel 2x vLLM's output throughput at concurrency 8; TTFT p50 20 vs 30 ms."""
    rows = []
    for backend, scale, ttft in (("llmaccel", 2.0, 20.0), ("openai:vllm", 1.0, 30.0)):
        for conc in (1, 8, 32):
            cfg = {"request_rate": "inf", "max_concurrency": conc, "load": f"concurrency={conc}"}
            rows += [rec("W3", backend, "out_tok_s", 100.0 * scale * conc / 8, **cfg),
                     rec("W3", backend, "request_throughput", scale * conc / 8, **cfg),
                     rec("W3", backend, "ttft_ms_p50", ttft * conc / 8, **cfg),
                     rec("W3", backend, "ttft_ms_p99", 2 * ttft * conc / 8, **cfg),
                     rec("W3", backend, "failed", 0, **cfg)]
    return rows


def w3_requests() -> list[dict[str, Any]]:
    rows = []
    for backend in ("llmaccel", "openai:vllm"):
        for conc in (1, 8):
            for i in range(20):
                rows.append({"workload": "W3", "model": "llama-3.2-1b", "backend": backend,
                             "load": f"concurrency={conc}", "success": True, "prompt_len": 100,
                             "output_len": 50, "ttft_ms": 10.0 + i, "tpot_ms": 5.0,
                             "e2e_ms": 300.0 + 10 * i, "itl_ms": [5.0, 6.0 + i / 10],
                             "error": ""})
            rows.append({"workload": "W3", "model": "llama-3.2-1b", "backend": backend,
                         "load": f"concurrency={conc}", "success": False, "prompt_len": 100,
                         "output_len": 0, "ttft_ms": None, "tpot_ms": None, "e2e_ms": None,
                         "itl_ms": [], "error": "timeout"})
    return rows


W1_TOK_S = {"bf16": 100.0, "rtn-int8": 150.0, "rtn-int4-g128": 180.0, "awq-int4-g128": 140.0,
            "fp8": 120.0}
W6_PPL = {"bf16": 10.0, "rtn-int8": 10.1, "rtn-int4-g128": 12.0, "awq-int4-g128": 11.0,
          "hqq-int4": 11.5}
# Pareto (max tok/s, min ppl) over the four shared formats: awq (140, 11) is dominated by
# rtn-int8 (150, 10.1); fp8 has no ppl, hqq-int4 no tok/s.
FRONT = ["bf16", "rtn-int8", "rtn-int4-g128"]


def w1_rows() -> list[dict[str, Any]]:
    return [rec("W1", "llmaccel", "tok_s", v, model="llama-3.2-3b", command="python w1.py",
                quantization=q, **({} if q == "bf16" else {"variant": q}))
            for q, v in W1_TOK_S.items()]


def w6_rows() -> list[dict[str, Any]]:
    return [rec("W6", "llmaccel", "ppl", v, model="qwen2.5-coder-0.5b", command="python w6.py",
                quantization=q, context=2048, stride=2048) for q, v in W6_PPL.items()]


def w5_rows() -> list[dict[str, Any]]:
    rows = []
    for method, base in (("ngram", 1.5), ("draft", 1.2)):
        for kind in ("code", "prose"):
            for batch in (1, 4, 16):
                row = rec("W5", "llmaccel", "speedup", round(base / batch ** 0.1, 3),
                          model="qwen2.5-coder-1.5b", command="python w5.py", batch=batch,
                          method=method, kind=kind, k=4, spec_steps=0 if batch == 16 else 9,
                          per_position_acceptance=[0.8, 0.6, 0.45, 0.3])
                row["acceptance_rate"] = 0.5       # top-level extras, as spec_bench writes
                row["mean_accepted_len"] = 2.25
                row["note"] = "a string: ignored"
                rows.append(row)
    return rows


def other_rows() -> list[dict[str, Any]]:
    return [rec("W2", "llmaccel", "out_tok_s", 200.0), rec("W2", "hf-cb", "out_tok_s", 100.0),
            rec("W4", "llmaccel", "ttft_ms_p50", 300.0, variant="prefix-cache-off"),
            rec("W4", "llmaccel", "ttft_ms_p50", 100.0, variant="prefix-cache-on"),
            rec("code", "llmaccel", "pass_at_1", 0.5, model="qwen2.5-coder-1.5b",
                variant="bf16"),
            rec("code", "llmaccel", "pass_at_1", 0.45, model="qwen2.5-coder-1.5b",
                variant="gptq-int4-g128")]


@pytest.fixture
def runs(tmp_path: Path) -> dict[str, Path]:
    d = tmp_path / "runs"
    d.mkdir()
    out = {"w3": write_jsonl(d / "w3.jsonl", w3_rows()), "w1": write_jsonl(d / "w1.jsonl",
                                                                           w1_rows()),
           "w6": write_jsonl(d / "w6.jsonl", w6_rows()), "w5": write_jsonl(d / "w5.jsonl",
                                                                           w5_rows()),
           "other": write_jsonl(d / "other.jsonl", other_rows())}
    write_jsonl(d / "w3.requests.jsonl", w3_requests())
    return out


# -- the whole report ---------------------------------------------------------------------------
def test_report_tables_ratios_and_plots(runs: dict[str, Path], tmp_path: Path) -> None:
    out = write_report([str(p) for p in runs.values()], tmp_path / "report", "Test report")
    md = out.markdown.read_text()
    assert md.startswith("# Test report\n")
    for p in runs.values():
        assert str(p) in md
    assert DEVICE in md and "abc1234" in md and "`python w5.py`" in md
    assert "w3.requests.jsonl: 84 requests, 4 failed" in md

    # W3: rows are backend @ load point, in numeric order; ratios at the same load point
    assert "## W3 — llama-3.2-1b" in md
    assert "| backend @ load | out_tok_s | request_throughput | ttft_ms_p50 |" in md
    lines = md.splitlines()
    idx = [lines.index(f"| llmaccel @ concurrency={c} | " + cells + " |")
           for c, cells in ((1, "25 | 0.25 | 2.5 | 5 | 0"), (8, "200 | 2 | 20 | 40 | 0"),
                            (32, "800 | 8 | 80 | 160 | 0"))]
    assert idx == sorted(idx)
    # out_tok_s 200 / 100 = 2.00x; ttft p50 (lower is better) 30 / 20 = 1.50x
    assert ("| llmaccel @ concurrency=8 vs openai:vllm @ concurrency=8 | 2.00× | 2.00× | "
            "1.50× | 1.50× |") in md
    assert "ttft_ms_p50 ↓" in md

    # W1 quantization vs bf16 (150 / 100), W6 ppl (lower is better: 10 / 12), W2, W4, code
    assert "| llmaccel [rtn-int8] vs llmaccel [bf16] | 1.50× |" in md
    assert "| llmaccel [rtn-int4-g128] vs llmaccel [bf16] | 0.833× |" in md
    assert "| llmaccel vs hf-cb | 2.00× |" in md
    assert "| llmaccel [prefix-cache-on] vs llmaccel [prefix-cache-off] | 3.00× |" in md
    assert "| llmaccel [gptq-int4-g128] vs llmaccel [bf16] | 0.90× |" in md

    # W5: method · kind · batch rows; the top-level extras became columns, the string did not
    assert "| method · kind · batch | speedup | acceptance_rate | mean_accepted_len |" in md
    assert "| ngram · code · batch 4 | 1.306 | 0.5 | 2.25 |" in md
    assert "note" not in md

    assert {p.name for p in out.images} == {
        "throughput_vs_load.png", "ttft_vs_load.png", "latency_cdf.png", "ppl_vs_tok_s.png",
        "acceptance_by_position.png", "speedup_vs_batch.png"}
    assert out.skipped == []
    for path in out.images:
        assert_png(path)
        assert f"]({path.name})" in md  # embedded with a relative link
    assert "perplexity from W6 records of qwen2.5-coder-0.5b" in md
    assert "tok/s from W1 records of llama-3.2-3b" in md
    assert f"Pareto front (no other format is both at least as fast and at most as " \
           f"perplexed): {', '.join(FRONT)}." in md
    assert "perplexity only (no W1 tok_s for llama-3.2-3b): hqq-int4" in md
    assert "speed only (no W6 ppl for qwen2.5-coder-0.5b): fp8" in md
    assert "llmaccel @ concurrency=8: 1 of 21 requests failed" in md


def test_missing_sidecar_skips_the_cdf_with_the_reason(runs: dict[str, Path],
                                                       tmp_path: Path) -> None:
    (runs["w3"].parent / "w3.requests.jsonl").unlink()
    out = write_report([str(runs["w3"])], tmp_path / "r")
    md = out.markdown.read_text()
    expected = runs["w3"].parent / "w3.requests.jsonl"
    assert f"Skipped: no per-request rows (missing: {expected})" in md
    assert not (tmp_path / "r" / "latency_cdf.png").exists()
    assert {p.name for p in out.images} == {"throughput_vs_load.png", "ttft_vs_load.png"}
    assert "Skipped: no W5 records with metric speedup" in md
    assert "Skipped: needs W6 `ppl` and W1 `tok_s` records" in md


def test_directory_input_skips_sidecars_and_non_result_files(runs: dict[str, Path],
                                                              tmp_path: Path) -> None:
    d = runs["w3"].parent
    write_jsonl(d / "w3.problems.jsonl", [{"problem": "x"}])
    write_jsonl(d / "trace-monitor.jsonl", [{"batch": 1, "steps": [1, 2]}])
    rs = load_runs([str(d)])
    assert sorted(f.path.name for f in rs.files) == ["other.jsonl", "w1.jsonl", "w3.jsonl",
                                                     "w5.jsonl", "w6.jsonl"]
    assert rs.files[[f.path.name for f in rs.files].index("w3.jsonl")].sidecar is not None
    assert any("trace-monitor.jsonl" in n and "skipped" in n for n in rs.notes)
    with pytest.raises(LLMAccelError, match=r"trace-monitor\.jsonl:1: not a result record"):
        load_runs([str(d / "trace-monitor.jsonl")])  # named directly: read strictly


def test_serving_rate_and_concurrency_sweeps(tmp_path: Path) -> None:
    """Rate points, capped points and all-at-once in one file: rows in sweep order, a second
    table for the latency percentiles of a wide table, two load axes, all-at-once noted."""
    latency = [f"{m}_ms_{s}" for m in ("ttft", "tpot", "itl", "e2e")
               for s in ("mean", "p50", "p95", "p99")]
    rows = []
    for backend, scale in (("llmaccel", 3.0), ("openai:sglang", 1.0)):
        for rate, conc in ((16, None), (1, None), ("inf", None), (4, 8), (4, 2)):
            cfg = {"request_rate": rate, "max_concurrency": conc}
            rows += [rec("W3", backend, m, scale * (conc or 1), **cfg)
                     for m in ("out_tok_s", "total_tok_s", "completed")]
            rows += [rec("W3", backend, m, 10.0 / scale, **cfg) for m in latency]
    out = write_report([str(write_jsonl(tmp_path / "w3.jsonl", rows))], tmp_path / "r")
    md = out.markdown.read_text()
    labels = [line.split(" | ")[0][2:] for line in md.splitlines()
              if line.startswith("| llmaccel @ ") and " vs " not in line]
    assert labels[:5] == ["llmaccel @ rate=1", "llmaccel @ rate=16",
                          "llmaccel @ rate=4,concurrency=2", "llmaccel @ rate=4,concurrency=8",
                          "llmaccel @ all-at-once"]
    assert len(labels) == 10  # the same rows again in the latency table
    assert "| backend @ load | out_tok_s | total_tok_s | completed |" in md
    assert "| backend @ load | ttft_ms_mean | ttft_ms_p50 |" in md
    assert "| llmaccel @ all-at-once vs openai:sglang @ all-at-once | 3.00× | 3.00× | 3.00× |" in md
    assert "not on a load axis (all at once, no cap): llmaccel @ all-at-once" in md
    assert_png(tmp_path / "r" / "throughput_vs_load.png")


# -- user errors --------------------------------------------------------------------------------
def test_malformed_lines_name_file_and_line(tmp_path: Path) -> None:
    good = json.dumps(rec("W2", "llmaccel", "out_tok_s", 1.0))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(good + "\n\n{not json\n")
    with pytest.raises(LLMAccelError, match=r"bad\.jsonl:3: not valid JSON"):
        write_report([str(bad)], tmp_path / "r")
    row = rec("W2", "llmaccel", "out_tok_s", 1.0)
    del row["value"], row["device"]
    write_jsonl(bad, [rec("W2", "llmaccel", "out_tok_s", 1.0), row])
    with pytest.raises(LLMAccelError, match=r"bad\.jsonl:2: .*missing key\(s\) value, device"):
        read_results(bad)
    write_jsonl(bad, [rec("W2", "llmaccel", "out_tok_s", "fast")])
    with pytest.raises(LLMAccelError, match=r"bad\.jsonl:1: \"value\" must be a number"):
        read_results(bad)
    side = tmp_path / "ok.requests.jsonl"
    write_jsonl(tmp_path / "ok.jsonl", [rec("W3", "llmaccel", "out_tok_s", 1.0)])
    side.write_text('{"backend": "llmaccel", "success": true}\n[1, 2]\n')
    with pytest.raises(LLMAccelError, match=r"ok\.requests\.jsonl:2: expected a JSON object"):
        load_runs([str(tmp_path / "ok.jsonl")])


def test_empty_and_missing_inputs(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(LLMAccelError, match="no result records in .*empty.jsonl"):
        write_report([str(empty)], tmp_path / "r")
    with pytest.raises(LLMAccelError, match="no result files given"):
        write_report([], tmp_path / "r")
    with pytest.raises(LLMAccelError, match="nope.jsonl: no such file or directory"):
        write_report([str(tmp_path / "nope.jsonl")], tmp_path / "r")
    (tmp_path / "d").mkdir()
    with pytest.raises(LLMAccelError, match="no \\*.jsonl result files"):
        write_report([str(tmp_path / "d")], tmp_path / "r")


# -- pieces -------------------------------------------------------------------------------------
def test_pareto_front() -> None:
    points = {"a": (100.0, 10.0), "b": (200.0, 12.0), "c": (150.0, 15.0),  # c: b dominates
              "d": (50.0, 9.0), "e": (90.0, 11.0),                          # e: a dominates
              "f": (200.0, 13.0)}                                           # f: b (same speed)
    assert pareto_front(points) == ["d", "a", "b"]
    assert pareto_front({"x": (1.0, 1.0), "y": (1.0, 1.0)}) == ["x", "y"]  # equal: both kept
    assert pareto_front({}) == []


def test_ppl_speed_join_picks_the_pair_sharing_most_formats() -> None:
    recs = records(w1_rows() + w6_rows()
                   + [rec("W1", "llmaccel", "tok_s", 999.0, model="other", quantization="fp8"),
                      rec("W6", "llmaccel", "ppl", 5.0, model="lora", quantization="bf16",
                          variant="lora-merged")])  # a LoRA merge is not a format
    join = join_ppl_speed(recs)
    assert join is not None
    assert (join.ppl_model, join.speed_model) == ("qwen2.5-coder-0.5b", "llama-3.2-3b")
    assert join.points == {q: (W1_TOK_S[q], W6_PPL[q])
                           for q in ("bf16", "rtn-int8", "rtn-int4-g128", "awq-int4-g128")}
    assert join.ppl_only == ["hqq-int4"] and join.speed_only == ["fp8"]
    assert join.not_used == [f"W1 other on {DEVICE} (1 formats)"]


def test_ppl_speed_join_takes_the_reference_variant_as_its_format() -> None:
    # A recipe labels the model as given `base` (bf16) and its LoRA merge `finetuned` (also
    # bf16): neither is a format unless named as the one the formats were made from.
    rows = [rec("W1", "llmaccel", "tok_s", 500.0, quantization="bf16", variant="base"),
            rec("W1", "llmaccel", "tok_s", 510.0, quantization="bf16", variant="finetuned"),
            rec("W1", "llmaccel", "tok_s", 900.0, quantization="rtn-int4-g128",
                variant="rtn-int4-g128"),
            rec("W6", "llmaccel", "ppl", 21.0, quantization="bf16", variant="base"),
            rec("W6", "llmaccel", "ppl", 19.0, quantization="bf16", variant="finetuned"),
            rec("W6", "llmaccel", "ppl", 27.0, quantization="rtn-int4-g128",
                variant="rtn-int4-g128")]
    assert join_ppl_speed(records(rows)).points == {"rtn-int4-g128": (900.0, 27.0)}
    assert join_ppl_speed(records(rows), "base").points == {"bf16": (500.0, 21.0),
                                                           "rtn-int4-g128": (900.0, 27.0)}
    assert join_ppl_speed(records(rows), "finetuned").points == {
        "bf16": (510.0, 19.0), "rtn-int4-g128": (900.0, 27.0)}


def test_rows_told_apart_by_a_category_not_a_counter() -> None:
    rows = [rec("W5", "llmaccel", "speedup", v, batch=1, method="head", kind="code",
                draft_vocab_size=vocab, spec_steps=steps)
            for v, vocab, steps in ((1.1, 21500, 117), (1.05, 151936, 103))]
    labels = [r.label for r in assign_rows(records(rows))]
    assert labels == ["head · code · batch 1 · draft_vocab_size=21500",
                      "head · code · batch 1 · draft_vocab_size=151936"]
    two_runs = [rec("W2", "llmaccel", "out_tok_s", 1.0, command=c) for c in ("a", "b")]
    assert [r.label for r in assign_rows(records(two_runs))] == ["llmaccel · run 1",
                                                                  "llmaccel · run 2"]


@pytest.mark.parametrize("fn, rows", [
    (plots.plot_throughput_vs_load, w3_rows), (plots.plot_ttft_vs_load, w3_rows),
    (plots.plot_ppl_vs_speed, lambda: w1_rows() + w6_rows()),
    (plots.plot_acceptance_by_position, w5_rows), (plots.plot_speedup_vs_batch, w5_rows)])
def test_each_plot_alone(fn, rows, tmp_path: Path) -> None:
    result = fn(records(rows()), tmp_path)
    assert_png(result.path)
    assert result.reason == ""
    skipped = fn(records(other_rows()), tmp_path / "none")
    assert skipped.path is None and skipped.reason
    assert not (tmp_path / "none").exists()


def test_latency_cdf_plot_alone(tmp_path: Path) -> None:
    result = plots.plot_latency_cdfs(w3_requests(), tmp_path)
    assert_png(result.path)
    failed_only = [r for r in w3_requests() if not r["success"]]
    skipped = plots.plot_latency_cdfs(failed_only, tmp_path / "x")
    assert skipped.path is None and "no successful request" in skipped.reason
    assert "missing: a.requests.jsonl" in plots.plot_latency_cdfs(
        [], tmp_path, ["a.requests.jsonl"]).reason


def test_command_prints_paths_and_raises_user_errors(runs: dict[str, Path],
                                                     tmp_path: Path) -> None:
    app = typer.Typer()
    app.command("report")(report)
    app.callback()(lambda: None)  # keep "report" a subcommand, as in cli.py
    out = tmp_path / "cli"
    res = CliRunner().invoke(app, ["report", str(runs["other"]), "--out", str(out),
                                   "--title", "T"])
    assert res.exit_code == 0, res.output
    assert str(out / "report.md") in res.output and "skipped" in res.output
    assert (out / "report.md").read_text().startswith("# T\n")
    res = CliRunner().invoke(app, ["report", str(tmp_path / "missing.jsonl")])
    assert isinstance(res.exception, LLMAccelError)


# -- real committed results ---------------------------------------------------------------------
def test_real_result_files(tmp_path: Path) -> None:
    w1 = REPO / "tests" / "data" / "w1-quant-llama-3.2-3b-h100.jsonl"  # an H100's W1 records
    w6 = RESULTS / "W6" / "2026-11-23-W6-quant-qwen2.5-coder-0.5b.jsonl"
    out = write_report([str(w1), str(w6)], tmp_path / "real")
    md = out.markdown.read_text()
    assert "## W1 — llama-3.2-3b" in md and "## W6 — qwen2.5-coder-0.5b" in md
    tok_s = {r.config["quantization"]: r.value for r in read_results(w1)
             if r.metric == "tok_s"}
    ppl = {r.config["quantization"]: r.value for r in read_results(w6)}
    assert (f"| llmaccel [rtn-int8] vs llmaccel [bf16] | "
            f"{tok_s['rtn-int8'] / tok_s['bf16']:.2f}× |") in md
    assert f"| llmaccel [nf4] vs llmaccel [bf16] | {ppl['bf16'] / ppl['nf4']:.3f}× |" in md
    assert [p.name for p in out.images] == ["ppl_vs_tok_s.png"]
    assert_png(out.images[0])
    shared = [q for q in tok_s if q in ppl]
    front = pareto_front({q: (tok_s[q], ppl[q]) for q in shared})
    assert f"perplexed): {', '.join(front)}." in md


def recipe_w5_rows() -> list[dict[str, Any]]:
    """W5 as `llmaccel bench spec` writes it in a recipe: config.variant is the cell's own
    name (batch included), config.quantization the target's format, the counters nested;
    batch 16 ran no speculative step (switched off)."""
    rows = []
    for quant in ("bf16", "gptq-int4-g128"):
        for method in ("draft", "ngram"):
            for batch in (1, 4, 16):
                steps = 0 if batch == 16 else 12
                rows.append(rec("W5", "llmaccel", "speedup", 1.0 + 0.1 / batch,
                                model="qwen2.5-coder-1.5b", command="llmaccel run r.yaml",
                                method=method, kind="code", batch=batch, quantization=quant,
                                variant=f"{method} code b{batch}", target_variant=quant,
                                spec_counters={"num_steps": steps},
                                per_position_acceptance=[0.7, 0.5] if steps else [0.0, 0.0]))
    return rows


def test_recipe_w5_rows_lines_and_panels(tmp_path: Path) -> None:
    rows = records(recipe_w5_rows())
    labels = [r.label for r in assign_rows(rows)]
    # the cell name repeats the point: it is not a variant (it split every line per batch)
    assert labels[0] == "draft · code · batch 1 [bf16]"
    assert not any(" b1" in lab or " b4" in lab for lab in labels)
    assert plots._spec_steps({"spec_counters": {"num_steps": 0}}) == 0
    assert plots._spec_steps({"spec_steps": 3}) == 3
    assert plots._spec_steps({}) is None
    speed = plots.plot_speedup_vs_batch(rows, tmp_path)
    assert_png(speed.path)
    assert "one panel per target quantization" in speed.caption and not speed.notes
    acc = plots.plot_acceptance_by_position(rows, tmp_path)
    assert_png(acc.path)
    assert acc.notes == ["4 runs drafted nothing (switched off at their batch size) and are "
                         "not drawn"]
    one = plots.plot_speedup_vs_batch([r for r in rows if r.config["quantization"] == "bf16"],
                                      tmp_path / "one")
    assert "panel" not in one.caption
