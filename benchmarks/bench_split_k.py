"""Split-K batch-1 GEMVs (int4 and FP8) against the tuned unsplit tiles, per layer shape.

    python benchmarks/bench_split_k.py --models llama-3.2-3b --budget-s 240 --pdl \\
        --out-jsonl split.jsonl --out-table llmaccel/kernels/configs/<gpu>.json

A narrow layer (N = hidden size: o_proj, down_proj) has only N / BLOCK_N programs at batch 1,
too few to keep every SM streaming and unevenly spread over the SMs. A split tile runs S
programs per row block, each over K / S columns, and writes fp32 partial sums [S, N] that the
next kernel adds (`rmsnorm` with partials: the residual add that follows o_proj and down_proj).
This times, per shape and format, the unsplit tile the engine uses today (the GEMV alone, into
the activation dtype; FP8 with `quantize_row_fp8` first where its tile says prequant, as the
engine runs it) against split tiles swept under a time budget (the current tile with S = 2..16
first, then a spread of others). Each tile is checked against the reference first.

Timing as in tune_gemm.py: a call inside a replayed CUDA graph of many calls cycling through
enough weight copies to defeat the L2 cache. With --out-table the fastest split tile of a
shape is merged as "w4gemv-partial:1:N:K" / "fp8gemv-partial:1:N:K" where it beat the unsplit
tile by more than 3% (read by `gemm_tuning.gemv_w4_partial_config` / `gemv_fp8_partial_config`).

--quick runs two tiny shapes on the CPU (Triton's interpreter) as a smoke test.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import time
from dataclasses import replace

import torch

from bench_w4_gemv import GROUP, MAX_COPIES, MIN_CYCLE_BYTES, _tune_gemm, time_cpu

SPLITS = (2, 3, 4, 6, 8, 12, 16)
MIN_GAIN = 1.03  # a split tile enters the table only this much faster than the unsplit one


def _splits(base, k: int, valid) -> list:
    return [replace(base, split_k=s) for s in SPLITS if valid(replace(base, split_k=s), k)]


def w4_candidates(n: int, k: int, base, quick: bool) -> list:
    from llmaccel.kernels.gemv_w4 import GemvW4Config, _valid_block_k, valid_split

    if quick:
        return [GemvW4Config(8, 64, 1, 2, 2, split_k=2), GemvW4Config(4, 128, 1, 2, 2, split_k=4)]
    ok = (lambda c, k: _valid_block_k(c.block_k, k, GROUP) and valid_split(c, k))
    first = _splits(base, k, ok)
    for bn in (8, 32):
        first += _splits(replace(base, block_n=bn), k, ok)
    space = [GemvW4Config(bn, bk, nw, ns, vec, split_k=s) for bn, bk, nw, ns, vec, s in
             itertools.product((4, 8, 16, 32), (128, 256, 512, 1024), (1, 2, 4), (2, 3, 4),
                               (2, 4), SPLITS)
             if 2 <= bn * bk / (256 * nw) <= 16 and vec <= bn * bk / (256 * nw)
             and 256 <= (n // bn) * s <= 4096]
    rest = [c for c in space if c not in first and ok(c, k)]
    random.Random(0).shuffle(rest)
    return first + rest


def fp8_candidates(n: int, k: int, base, quick: bool) -> list:
    from llmaccel.kernels.gemv_fp8 import GemvFp8Config, valid_split

    if quick:
        return [GemvFp8Config(8, 64, 1, 2, split_k=2), GemvFp8Config(4, 128, 1, 2, True, 4)]
    base = replace(base, prequant=True)
    first = _splits(base, k, valid_split)
    for bn in (2 * base.block_n, max(1, base.block_n // 2)):
        first += _splits(replace(base, block_n=bn), k, valid_split)
    space = [GemvFp8Config(bn, bk, nw, ns, True, s) for bn, bk, nw, ns, s in
             itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048), (1, 2, 4, 8), (2, 3),
                               SPLITS)
             if 1 <= bn * bk / (16 * 32 * nw) <= 8 and 256 <= (n // bn) * s <= 4096]
    rest = [c for c in space if c not in first and valid_split(c, k)]
    random.Random(0).shuffle(rest)
    return first + rest


def bench(fmt: str, n: int, k: int, users: list[str], dev, budget_s: float, tg, quick: bool):
    from llmaccel.kernels import gemm_tuning
    from llmaccel.kernels.gemm import linear_ref
    from llmaccel.kernels.gemv_fp8 import (GemvFp8Config, default_gemv_fp8_config, fp8_gemv,
                                           fp8_gemv_partials, fp8_gemv_ref)
    from llmaccel.kernels.gemv_w4 import default_gemv_w4_config, w4a16_gemv, w4a16_gemv_partials
    from llmaccel.quant.fp8 import FP8_DTYPE

    t0 = time.time()
    nbytes = n * k // 2 + 2 * n * (k // GROUP) if fmt == "w4" else n * k + 4 * n
    copies = 2 if quick else max(2, min(MAX_COPIES, -(-MIN_CYCLE_BYTES // nbytes)))
    calls = 4 if quick else max(24, copies)
    timer = time_cpu if quick else tg.time_graph
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    if fmt == "w4":
        ws = tg.make_weights(4, n, k, GROUP, copies, dev)
        base = (gemm_tuning.gemv_w4_config(n, k, GROUP, dev) if dev.type == "cuda" else None) \
            or default_gemv_w4_config(n, k, GROUP)
        ref = linear_ref(x.float(), ws[0][0], 4, ws[0][1].float(), None, GROUP)[0]
        full = lambda i, c: w4a16_gemv(x, ws[i][0], ws[i][1], None, GROUP, config=c)  # noqa: E731
        part = lambda i, c: w4a16_gemv_partials(x, ws[i][0], ws[i][1], None, GROUP, c)  # noqa
        cands = w4_candidates(n, k, base, quick)
    else:
        ws = [((torch.randn(n, k, device=dev) * 0.5).to(FP8_DTYPE),
               torch.rand(n, 1, device=dev) * 0.01 + 1e-3) for _ in range(copies)]
        base = (gemm_tuning.gemv_fp8_config(n, k, dev) if dev.type == "cuda" else None) \
            or default_gemv_fp8_config(n, k)
        ref = fp8_gemv_ref(x.float(), *ws[0])[0]
        full = lambda i, c: fp8_gemv(x, ws[i][0], ws[i][1], config=c)  # noqa: E731
        part = lambda i, c: fp8_gemv_partials(x, ws[i][0], ws[i][1], c)  # noqa: E731
        cands = fp8_candidates(n, k, base if isinstance(base, GemvFp8Config) else None, quick)
    base_us = timer(lambda i: full(i, base), copies, calls)
    timed = []
    for cfg in cands:
        if not quick and time.time() - t0 > budget_s and timed:
            break
        try:
            got = part(0, cfg).sum(0)
            err = (got - ref).abs().max().item()
            if err > 2e-2 * ref.abs().max().item():
                print(f"  {cfg.describe()}: wrong result (max error {err:.3g}), skipped")
                continue
            us = timer(lambda i, cfg=cfg: part(i, cfg), copies, calls)
        except Exception as e:  # noqa: BLE001 (e.g. out of shared memory)
            print(f"  {cfg.describe()}: {type(e).__name__}: {str(e)[:120]}")
            continue
        timed.append((us, cfg))
    best_us, best = min(timed, key=lambda t: t[0])
    print(f"{fmt:<4} {n:>6} x {k:<5} unsplit {base.describe():<20} {base_us:7.2f} us "
          f"({nbytes / base_us / 1e3:5.0f} GB/s) | split {best.describe():<22} {best_us:7.2f} us "
          f"({nbytes / best_us / 1e3:5.0f} GB/s) x{base_us / best_us:4.2f} [{len(timed)} tiles]",
          flush=True)
    record = {
        "workload": f"{fmt}gemv-split", "model": ",".join(users), "load_format": "dummy",
        "backend": "llmaccel",
        "config": {"m": 1, "n": n, "k": k, "format": fmt, "kernel": best.describe(),
                   "unsplit_kernel": base.describe(), "tiles_timed": len(timed),
                   "group_size": GROUP if fmt == "w4" else None},
        "metric": "us", "value": round(best_us, 2), "gbps": round(nbytes / best_us / 1e3, 1),
        "unsplit_us": round(base_us, 2), "unsplit_gbps": round(nbytes / base_us / 1e3, 1),
        "speedup_vs_unsplit": round(base_us / best_us, 3),
        "top5": [(round(us, 2), c.describe()) for us, c in sorted(timed, key=lambda t: t[0])[:5]],
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__, "commit": os.environ.get("LLMACCEL_COMMIT", "unknown"),
        "command": "python benchmarks/bench_split_k.py" + (" --quick" if quick else ""),
    }
    entry = {"backend": "triton", "config": best.__dict__, "us": round(best_us, 2),
             "unsplit_us": round(base_us, 2), "model": ",".join(users)}
    return record, entry


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama-3.2-3b")
    ap.add_argument("--layers", default="o,down,qkv",
                    help="which layers' shapes (o, down, qkv, gate_up)")
    ap.add_argument("--formats", default="w4,fp8")
    ap.add_argument("--out-jsonl", default="split.jsonl")
    ap.add_argument("--out-table", default=None)
    ap.add_argument("--budget-s", type=float, default=240, help="for the whole sweep")
    ap.add_argument("--pdl", action="store_true", help="launch as the engine does on Hopper")
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (interpreter)")
    args = ap.parse_args(argv)
    if args.quick and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from llmaccel.kernels import pdl
    from llmaccel.kernels.gemm_tuning import write_table

    tg = _tune_gemm()
    layers = set(args.layers.split(","))
    if args.quick:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        shapes = {(40, 256): ["quick"]}
    else:
        dev = torch.device("cuda")
        shapes = {nk: users for nk, users in tg.linear_shapes(args.models.split(",")).items()
                  if any(u.split(":")[1] in layers for u in users)}
    if args.pdl:
        print(f"PDL {'on' if pdl.configure(dev, requested=True) else 'unsupported here: off'}")
    jobs = [(f, nk, u) for f in args.formats.split(",") for nk, u in shapes.items()]
    t0 = time.time()
    records, entries = [], {}
    for i, (fmt, (n, k), users) in enumerate(jobs):
        budget = (args.budget_s - (time.time() - t0)) / (len(jobs) - i)
        record, entry = bench(fmt, n, k, users, dev, budget, tg, args.quick)
        record["config"]["pdl"] = pdl.enabled()
        records.append(record)
        if record["speedup_vs_unsplit"] > MIN_GAIN:
            entries[f"{fmt}gemv-partial:1:{n}:{k}"] = entry
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    with open(args.out_jsonl, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    print("\n| format | layers | N | K | unsplit us | GB/s | split us | GB/s | split tile | x |"
          "\n|---|---|---|---|---|---|---|---|---|---|")
    for r in records:
        c = r["config"]
        print(f"| {c['format']} | {r['model']} | {c['n']} | {c['k']} | {r['unsplit_us']:.2f} | "
              f"{r['unsplit_gbps']:,.0f} | {r['value']:.2f} | {r['gbps']:,.0f} | {c['kernel']} | "
              f"{r['speedup_vs_unsplit']:.2f} |")
    if args.out_table:
        name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
        path = write_table(args.out_table, name, entries)
        print(f"{len(entries)} split entries -> {path}")
    print(f"done in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
