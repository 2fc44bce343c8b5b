"""The OpenAI server's cost at each W3 load: records of `openai:<server>` against `llmaccel`
(our engine in process) from one results file (benchmarks/issue9_gpu.sh makes it), as a
markdown table of both values and their ratio.
    python benchmarks/w3_api_overhead.py RESULTS.jsonl [--server openai:llmaccel]"""

from __future__ import annotations

import argparse
import json

from llmaccel.bench.report import fmt_value

METRICS = ["request_throughput", "out_tok_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50",
           "itl_ms_p50", "e2e_ms_p50", "failed"]


def table(path: str, server: str, baseline: str = "llmaccel") -> str:
    values: dict[tuple[str, str, str], float] = {}
    loads: list[str] = []
    for line in open(path):
        r = json.loads(line)
        load = r["config"]["load"]
        if load not in loads:
            loads.append(load)
        values[(r["backend"], load, r["metric"])] = r["value"]
    rows = [f"| load | metric | {baseline} (in process) | {server} | {server} / {baseline} |",
            "|---|---|---|---|---|"]
    for load in loads:
        for m in METRICS:
            a, b = values.get((baseline, load, m)), values.get((server, load, m))
            if a is None or b is None:
                continue
            ratio = f"{b / a:.2f}" if a else "–"
            rows.append(f"| {load} | {m} | {fmt_value(a)} | {fmt_value(b)} | {ratio} |")
    return "\n".join(rows)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--server", default="openai:llmaccel")
    args = ap.parse_args()
    print(table(args.results, args.server))
