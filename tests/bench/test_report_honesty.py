"""What the report claims about its own numbers: latency CDF titles name the workloads (and
in process or over HTTP) the per-request rows came from, and roofline percentages name the
bandwidth figure they are a percent of, with a reason wherever one exceeds 100."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmaccel.bench import plots
from llmaccel.bench.report import load_runs, write_report
from llmaccel.bench.results import Record, summary_markdown

H100 = "NVIDIA H100 80GB HBM3"
CPU = "cpu (x86_64)"
CPU_COPY = "cpu memcpy (tensor copy_, host clock)"


def rec(workload: str, backend: str, metric: str, value: float, device: str = H100,
        **config: Any) -> dict[str, Any]:
    return {"workload": workload, "model": "llama-3.2-1b", "load_format": "dummy",
            "backend": backend, "config": config, "metric": metric, "value": value,
            "device": device, "torch": "2.11.0", "commit": "abc1234",
            "command": "llmaccel bench"}


def request_rows(workload: str | None, backend: str, load: str,
                 n: int = 10) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        row = {"workload": workload, "model": "llama-3.2-1b", "backend": backend,
               "load": load, "success": True, "prompt_len": 100, "output_len": 50,
               "ttft_ms": 10.0 + i, "tpot_ms": 5.0, "e2e_ms": 300.0 + 10 * i,
               "itl_ms": [5.0, 6.0], "error": ""}
        if workload is None:
            del row["workload"]
        rows.append(row)
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cdf_section(md: str) -> str:
    """The report's latency-CDF section: its heading up to the next heading."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines)
                 if line.startswith("### ") and "latency CDF" in line)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("#")),
               len(lines))
    return "\n".join(lines[start:end])


# -- latency CDF titles -------------------------------------------------------------------------
def test_w2_sidecar_gives_a_w2_cdf_title_not_w3(tmp_path: Path) -> None:
    w2 = write_jsonl(tmp_path / "w2.jsonl", [rec("W2", "llmaccel", "out_tok_s", 200.0)])
    write_jsonl(tmp_path / "w2.requests.jsonl",
                request_rows("W2", "llmaccel", "all-at-once"))
    out = write_report([str(w2)], tmp_path / "r")
    section = cdf_section(out.markdown.read_text())
    assert "W3" not in section
    assert section.startswith("### W2 per-request latency CDFs (in process)")
    assert "latency_cdf.png" in section


def test_cdf_title_from_the_result_file_when_rows_name_no_workload(tmp_path: Path) -> None:
    w1 = write_jsonl(tmp_path / "w1.jsonl", [rec("W1", "openai:vllm", "tok_s", 100.0)])
    write_jsonl(tmp_path / "w1.requests.jsonl", request_rows(None, "openai:vllm", "batch=1"))
    w2 = write_jsonl(tmp_path / "w2.jsonl", [rec("W2", "llmaccel", "out_tok_s", 200.0)])
    write_jsonl(tmp_path / "w2.requests.jsonl",
                request_rows("W2", "llmaccel", "all-at-once"))
    rs = load_runs([str(w1), str(w2)])
    assert {row["workload"] for row in rs.requests} == {"W1", "W2"}
    result = plots.plot_latency_cdfs(rs.requests, tmp_path)
    assert result.title == "W1, W2 per-request latency CDFs (in process and over HTTP)"
    assert "W1, W2" in result.caption and "W3" not in result.caption
    # rows no file vouches for say so instead of naming a workload
    bare = plots.plot_latency_cdfs(request_rows(None, "hf-eager", "batch=1"), tmp_path / "b")
    assert bare.title == "Per-request latency CDFs (in process; workload not recorded)"


def test_w3_title_and_named_sidecar_is_not_missing(tmp_path: Path) -> None:
    w3 = write_jsonl(tmp_path / "w3.jsonl",
                     [rec("W3", "openai:vllm", "out_tok_s", 100.0, load="rate=4")])
    side = write_jsonl(tmp_path / "w3.requests.jsonl",
                       request_rows("W3", "openai:vllm", "rate=4"))
    rs = load_runs([str(w3), str(side)])
    assert rs.missing_sidecars == []
    md = write_report([str(w3), str(side)], tmp_path / "r").markdown.read_text()
    section = cdf_section(md)
    assert section.startswith("### W3 per-request latency CDFs (over HTTP)")
    assert "no sidecar" not in section
    # a W2 file without a sidecar is not expected to have one (engine runs write none)
    w2 = write_jsonl(tmp_path / "w2.jsonl", [rec("W2", "llmaccel", "out_tok_s", 1.0)])
    (tmp_path / "w3.requests.jsonl").unlink()
    assert load_runs([str(w2), str(w3)]).missing_sidecars == [side]


# -- roofline percentages -----------------------------------------------------------------------
def roofline_config(copy_gbps: float, method: str) -> dict[str, Any]:
    return {"batch": 1, "weight_bytes": 2.47e9, "kv_bytes_per_token": 32768,
            "kv_tokens_per_step": 256.0, "bytes_per_step": 2.48e9, "copy_gbps": copy_gbps,
            "copy_method": method, "copy_nbytes": 2**26,
            "roofline_tok_s": round(copy_gbps * 1e9 / 2.48e9, 1),
            "rate_basis": "tok_s (median, prefill included)"}


def over_copy_records() -> list[dict[str, Any]]:
    cfg = roofline_config(20.0, CPU_COPY)
    return [rec("W1", "llmaccel", "tok_s", 10.48, device=CPU, **cfg),
            rec("W1", "llmaccel", "gbps", 26.0, device=CPU, **cfg),
            rec("W1", "llmaccel", "pct_roofline", 130.0, device=CPU, **cfg)]


def test_pct_roofline_over_100_is_named_and_explained_in_the_report(tmp_path: Path) -> None:
    w1 = write_jsonl(tmp_path / "w1.jsonl", over_copy_records())
    md = write_report([str(w1)], tmp_path / "r").markdown.read_text()
    assert "| llmaccel | 10.48 | 26 | 130 |" in md  # the recorded value, as recorded
    assert f"% of measured copy bandwidth 20 GB/s ({CPU_COPY})" in md
    assert "pct_roofline 130 > 100" in md
    assert "understates read bandwidth" in md


def test_pct_roofline_over_100_is_named_and_explained_in_the_bench_summary() -> None:
    md = summary_markdown([Record.from_dict(r) for r in over_copy_records()])
    assert "| llmaccel | 10.48 | 26 | 130 |" in md
    assert f"% of measured copy bandwidth 20 GB/s ({CPU_COPY})" in md
    assert "pct_roofline 130 > 100" in md and "understates read bandwidth" in md


def test_pct_roofline_names_the_datasheet_figure_where_the_device_is_known(
        tmp_path: Path) -> None:
    cfg = roofline_config(2800.0, "cuda d2d copy_, CUDA events")
    rows = [rec("W1", "llmaccel", "pct_roofline", 50.0, **cfg),
            rec("W1", "llmaccel", "pct_roofline", 50.0, device="NVIDIA L40S", **cfg,
                variant="other-gpu")]
    md = write_report([str(write_jsonl(tmp_path / "w1.jsonl", rows))],
                      tmp_path / "r").markdown.read_text()
    assert "% of measured copy bandwidth 2,800 GB/s (cuda d2d copy_, CUDA events)" in md
    # 50% of 2800 = 1400 GB/s achieved; 1400 / 3350 = 41.8% of the H100 SXM datasheet figure
    assert "41.8% of the H100 SXM datasheet bandwidth 3,350 GB/s" in md
    assert md.count("datasheet bandwidth") == 1  # no datasheet figure for an unlisted device
    assert "> 100" not in md
