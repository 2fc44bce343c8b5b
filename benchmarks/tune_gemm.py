"""Tune and measure `kernels/gemm.py` on this GPU: every linear shape of the named models, for
dense bf16 (against cuBLAS through F.linear), W8A16 per-channel and W4A16 group-128 (against
the same shape's dense bf16 cuBLAS), at decode and prefill batch sizes.

    python benchmarks/tune_gemm.py --out-table llmaccel/kernels/configs/<gpu>.json \
        --out-jsonl results.jsonl

Each timing replays a CUDA graph of 24 calls that cycle through enough weight copies to defeat
the L2 cache (each layer of a real model reads different weights), so a figure is what one
layer costs inside the engine's decode graph. Writes the tuning table read by
`kernels/gemm_tuning.py` and one JSONL record per (shape, bits, M) with the best config.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from llmaccel.bench.results import current_commit
from llmaccel.kernels.gemm import GemmConfig, pack_int4_rows, triton_linear
from llmaccel.kernels.gemm_tuning import write_table
from llmaccel.models.shapes import SHAPES

CALLS = 24
L2_DEFEAT_BYTES = 256 * 2**20


def projection_shapes(name: str) -> dict[str, tuple[int, int]]:
    """(N, K) of a shape's fused projections: qkv, o, gate_up, down and the LM head."""
    c = SHAPES[name]
    h, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or h // heads
    inter = c["intermediate_size"]
    return {"qkv": ((heads + 2 * kv) * hd, h), "o": (h, heads * hd), "gate_up": (2 * inter, h),
            "down": (h, inter), "lm_head": (c["vocab_size"], h)}


def linear_shapes(names: list[str]) -> dict[tuple[int, int], list[str]]:
    """(N, K) -> layer names using it, for q/k/v, o, gate/up, down and the LM head."""
    out: dict[tuple[int, int], list[str]] = {}
    for name in names:
        for label, nk in projection_shapes(name).items():
            out.setdefault(nk, []).append(f"{name}:{label}")
    return out


def configs(bits: int, m: int, group: int) -> list[GemmConfig]:
    ws = ((4, 3), (4, 5), (8, 4))
    if m == 1:  # broadcast multiply-and-sum (no tensor-core layout), and a few dot tiles
        if bits == 16:
            fma = itertools.product((2, 4, 8), (512, 1024, 2048), ws)
        else:  # tiles within one group take the cheap scale-after-product path
            ks = [bk for bk in (64, 128, 256, 512) if group == -1 or bk <= group]
            fma = itertools.product((4, 8, 16, 32), ks, ws)
        return [GemmConfig(1, bn, bk, False, w, s) for bn, bk, (w, s) in fma] + \
            [GemmConfig(16, bn, bk, True, 4, 4) for bn, bk in itertools.product((16, 32),
                                                                                 (64, 128))]
    if m <= 16:
        return [GemmConfig(16, bn, bk, True, w, 4)
                for bn, bk, w in itertools.product((16, 32, 64), (64, 128, 256), (4, 8))]
    return [GemmConfig(bm, bn, bk, True, w, 3)
            for bm, bn, bk, w in itertools.product((64, 128), (64, 128), (64, 128), (4,))] + \
        [GemmConfig(bm, 128, 64, True, 8, 3) for bm in (64, 128)] + \
        [GemmConfig(bm, 64, 128, True, 8, 4) for bm in (64, 128)]


def make_weights(bits: int, n: int, k: int, group: int, copies: int, dev: torch.device):
    out = []
    for _ in range(copies):
        if bits == 16:
            out.append((torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02, None, None))
            continue
        codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, device=dev)
        g = 1 if group == -1 else k // group
        scales = (torch.rand(n, g, device=dev) * 0.01).to(torch.bfloat16)
        zeros = torch.randint(0, 2**bits, (n, g), dtype=torch.uint8, device=dev)
        w = codes if bits == 8 else pack_int4_rows(codes)
        out.append((w, scales, zeros))
    return out


def time_graph(fn, copies: int, calls: int = CALLS) -> float:
    """Microseconds per call of fn(i) inside a captured graph of `calls` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            fn(i % copies)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i % copies)
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 10
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (reps * calls)


def summarize(jsonl: Path) -> str:
    """A markdown table of a tuning run's records: per shape, bits and M, the best Triton
    time against cuBLAS bf16 on the same shape (ratio computed here from the records)."""
    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    first = rows[0] if rows else {}
    out = [f"# Triton linear kernel vs cuBLAS bf16 ({first.get('device')}, torch "
           f"{first.get('torch')}, commit `{first.get('commit')}`)", "",
           f"Command: `python benchmarks/tune_gemm.py`; summary: `python benchmarks/tune_gemm.py "
           f"--summarize {jsonl.name}`. One call = one layer inside a CUDA graph, weights "
           "cycled past L2. Ratio > 1: the Triton kernel on the quantized (or bf16) weight is "
           "faster than cuBLAS on the bf16 weight.", "",
           "| layers | bits | M | N | K | triton us | GB/s | cuBLAS bf16 us | ratio | tile |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["config"]
        out.append(f"| {r['model']} | {c['bits']} | {c['m']} | {c['n']} | {c['k']} | "
                   f"{r['value']:.2f} | {r['gbps']:,.0f} | {r['cublas_bf16_us']:.2f} | "
                   f"{r['cublas_bf16_us'] / r['value']:.2f} | {c['kernel']} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--summarize", type=Path, default=None,
                    help="print the markdown summary of a results .jsonl and exit")
    ap.add_argument("--models", default="llama-3.2-1b,llama-3.2-3b,qwen2.5-1.5b")
    ap.add_argument("--bits", default="16,4,8")
    ap.add_argument("--ms", default="1,16,128")
    ap.add_argument("--out-table", default="auto",
                    help="'auto': llmaccel/kernels/configs/<this GPU>.json")
    ap.add_argument("--out-jsonl", default="gemm.jsonl")
    ap.add_argument("--budget-s", type=float, default=480)
    args = ap.parse_args()
    if args.summarize:
        print(summarize(args.summarize), end="")
        return
    dev = torch.device("cuda")
    t0 = time.time()
    gpu = torch.cuda.get_device_name()
    commit = current_commit()
    entries: dict[str, dict] = {}
    records: list[dict] = []
    shapes = linear_shapes(args.models.split(","))
    for bits in (int(b) for b in args.bits.split(",")):
        group = {16: -1, 8: -1, 4: 128}[bits]
        for (n, k), users in shapes.items():
            if bits != 16 and all(u.endswith("lm_head") for u in users):
                continue  # the LM head stays unquantized
            nbytes = n * k * {16: 2, 8: 1, 4: 0.5}[bits]
            copies = max(1, min(16, int(L2_DEFEAT_BYTES // nbytes) + 1))
            ws = make_weights(bits, n, k, group, copies, dev)
            dense = make_weights(16, n, k, -1, max(1, min(16, int(L2_DEFEAT_BYTES // (2 * n * k))
                                                      + 1)), dev)
            for m in (int(v) for v in args.ms.split(",")):
                if bits == 16 and m > 16:
                    continue  # cuBLAS's large-M GEMMs are not what this kernel is for
                if time.time() - t0 > args.budget_s:
                    break
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                cublas_us = time_graph(lambda i: F.linear(x, dense[i][0]), len(dense))
                best: tuple[float, GemmConfig] | None = None
                for cfg in configs(bits, m, group):
                    def call(i, cfg=cfg):
                        w, s, z = ws[i]
                        return triton_linear(x, w, bits, s, z, group, None, cfg)
                    try:
                        us = time_graph(call, copies)
                    except Exception as e:  # e.g. out of shared memory for a large tile
                        print(f"skip {cfg.describe()}: {type(e).__name__}")
                        continue
                    if best is None or us < best[0]:
                        best = (us, cfg)
                if best is None:
                    continue
                us, cfg = best
                backend = "triton" if bits != 16 or us < cublas_us else "cublas"
                entries[f"{bits}:{m}:{n}:{k}"] = {
                    "backend": backend, "config": cfg.__dict__, "triton_us": round(us, 2),
                    "cublas_bf16_us": round(cublas_us, 2)}
                gbps = nbytes / us / 1e3
                records.append({
                    "workload": "gemm", "model": ",".join(users), "load_format": "dummy",
                    "backend": "llmaccel", "config": {"bits": bits, "group_size": group, "m": m,
                                                      "n": n, "k": k, "kernel": cfg.describe()},
                    "metric": "us", "value": round(us, 2), "device": gpu,
                    "torch": torch.__version__, "commit": commit,
                    "command": "python benchmarks/tune_gemm.py", "gbps": round(gbps, 1),
                    "cublas_bf16_us": round(cublas_us, 2)})
                print(f"{bits:>2}b m={m:<4} n={n:<6} k={k:<5} triton {us:8.2f} us "
                      f"({gbps:6.0f} GB/s, {cfg.describe()})  cuBLAS bf16 {cublas_us:8.2f} us  "
                      f"x{cublas_us / us:5.2f}", flush=True)
            ws = dense = []  # free the copies before the next shape
            torch.cuda.empty_cache()
    out_table = write_table(args.out_table, gpu, entries, torch=torch.__version__,
                            commit=commit)
    with open(args.out_jsonl, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    print(f"{len(entries)} entries in {time.time() - t0:.0f} s -> {out_table}")


if __name__ == "__main__":
    main()
