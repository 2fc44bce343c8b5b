"""Batch-1 W4A16 GEMV on this GPU: the dedicated kernel (`kernels/gemv_w4.py`) against cuBLAS on
the dense bf16 weight and against the general Triton kernel (`kernels/gemm.py` BITS=4 with its
tuned tile), for every linear shape of the named models (not the LM head), group 128, with
symmetric (no zeros) and asymmetric (uint8 zeros) weights.

    python benchmarks/bench_w4_gemv.py --models llama-3.2-3b,llama-3.2-1b \\
        --out-jsonl w4gemv.jsonl --out-table llmaccel/kernels/configs/<gpu>.json

Timing as in tune_gemm.py: one figure is a call inside a replayed CUDA graph of many calls
that cycle through enough weight copies to defeat the L2 cache (here at least 256 MB of
weights, so even a 2 MB int4 matrix is read from HBM). GB/s counts the weight bytes read
(codes, scales, zeros). The new kernel's tile is swept under a time budget (configs that share
constexprs compile once for all shapes); the asymmetric case re-times the best symmetric
tiles. With --out-table the best tile per shape is merged into the tuning table as
"w4gemv:1:N:K" (read by `gemm_tuning.gemv_w4_config`).

--quick runs two tiny shapes on the CPU (Triton's interpreter) as a smoke test of the script.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
from llmaccel.bench.results import current_commit

MIN_CYCLE_BYTES = 256 * 2**20  # weight bytes cycled through per timing: > 5x the H100's L2
MAX_COPIES = 96
TOP_ASYM = 3  # best symmetric tiles re-timed with zeros (outside the budget)
GROUP = 128


def _tune_gemm():
    """benchmarks/tune_gemm.py as a module (its shapes and weight helpers)."""
    spec = importlib.util.spec_from_file_location("tune_gemm",
                                                  Path(__file__).with_name("tune_gemm.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# Tiles measured best on an H100 for some llama-3.2 shape (benchmarks/bench_w4_gemv.py, 2026-11),
# tried first; then the rest of the space, most words per thread first.
SEEDS = ((16, 512, 2, 3, 2), (16, 256, 1, 3, 2), (8, 256, 1, 3, 2), (16, 1024, 4, 3, 2),
         (8, 512, 4, 3, 4), (4, 512, 4, 3, 2), (8, 1024, 8, 3, 4), (8, 512, 1, 2, 2),
         (4, 1024, 8, 3, 2), (4, 256, 1, 3, 2),
         # a whole row (or half) in one tile: every weight load of a program issued at once,
         # before the PDL wait, instead of a chain of dependent K iterations
         (2, 4096, 2, 2, 4), (4, 4096, 4, 2, 4), (2, 8192, 4, 2, 4), (4, 2048, 2, 2, 4),
         (1, 4096, 1, 2, 4), (8, 4096, 8, 2, 4), (1, 8192, 2, 2, 4), (4, 8192, 8, 2, 4))


def candidates(n: int, k: int, group: int, quick: bool = False) -> list:
    """Tiles to try, likeliest first; words per thread (block_n * block_k / 8 / threads)
    between 2 and 16 (fewer leaves threads idle, more spills registers). vec 1 (one word per
    load) measured 2-4x slower everywhere and is left out."""
    from llmaccel.kernels.gemv_w4 import GemvW4Config, _valid_block_k

    if quick:
        return [GemvW4Config(8, 64, 1, 2, 2), GemvW4Config(16, 128, 2, 3, 2),
                GemvW4Config(4, 256, 1, 2, 4)]
    space = [GemvW4Config(bn, bk, nw, ns, vec) for bn, bk, nw, ns, vec in itertools.product(
        (1, 2, 4, 8, 16), (64, 128, 256, 512, 1024, 2048, 4096, 8192), (1, 2, 4, 8), (2, 3, 4),
        (2, 4))
        if 2 <= bn * bk / (256 * nw) <= 16 and vec <= bn * bk / (256 * nw)]
    seeds = [GemvW4Config(*t) for t in SEEDS]
    rest = sorted((c for c in space if c not in seeds),
                  key=lambda c: (-c.block_n * c.block_k / c.num_warps, c.num_stages != 3,
                                 c.vec, c.num_warps))
    # a tile may overhang K (masked: 3072 in a 4096 tile is one iteration), but not by 2x
    return [c for c in seeds + rest if c.block_k < 2 * k and _valid_block_k(c.block_k, k, group)]


def time_cpu(fn, copies: int, calls: int) -> float:
    """--quick: wall-clock microseconds per call (the interpreter's, meaningless as speed)."""
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i % copies)
    return (time.perf_counter() - t0) * 1e6 / calls


def _time_dense(x, n: int, k: int, copies: int, tg, timer, calls: int | None) -> float:
    """cuBLAS (F.linear) on copies of a dense bf16 weight, freed on return."""
    dense = tg.make_weights(16, n, k, -1, copies, x.device)
    return timer(lambda i: torch.nn.functional.linear(x, dense[i][0]), copies,
                 calls or max(24, copies))


def bench_shape(n: int, k: int, users: list[str], dev: torch.device, budget_s: float,
                tg, quick: bool) -> tuple[dict, dict | None]:
    """Times cuBLAS bf16, the general kernel and the new kernel's tiles on one shape.
    Returns (record, table entry)."""
    from llmaccel.kernels.gemm import linear_ref, triton_linear
    from llmaccel.kernels.gemm_tuning import packed_config
    from llmaccel.kernels.gemv_w4 import w4a16_gemv

    t0 = time.time()
    g = k // GROUP
    q_bytes = {"sym": n * k // 2 + 2 * n * g, "asym": n * k // 2 + 3 * n * g}
    dense_bytes = 2 * n * k
    copies = 2 if quick else max(2, min(MAX_COPIES, -(-MIN_CYCLE_BYTES // q_bytes["sym"])))
    calls = 4 if quick else max(24, copies)
    dense_copies = 2 if quick else max(2, min(MAX_COPIES, -(-MIN_CYCLE_BYTES // dense_bytes)))
    timer = time_cpu if quick else tg.time_graph  # tune_gemm's CUDA-graph timer
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    cublas_us = _time_dense(x, n, k, dense_copies, tg, timer, calls if quick else None)
    ws = tg.make_weights(4, n, k, GROUP, copies, dev)
    old_cfg = packed_config(1, n, k, 4, GROUP, dev)
    out: dict = {}
    for variant in ("sym", "asym"):
        zeros = (lambda i: None) if variant == "sym" else (lambda i: ws[i][2])
        # the new kernel must agree with the reference before it is timed
        w0, s0 = ws[0][0], ws[0][1]
        ref = linear_ref(x.float(), w0, 4, s0.float(), zeros(0), GROUP)
        old_us = timer(lambda i, zeros=zeros: triton_linear(x, ws[i][0], 4, ws[i][1], zeros(i),
                                                            GROUP, config=old_cfg), copies, calls)
        if variant == "sym":
            cands = candidates(n, k, GROUP, quick)
        else:  # the best symmetric tiles
            cands = [c for _, c in sorted(out["sym"]["timed"], key=lambda t: t[0])[:TOP_ASYM]]
        timed = []
        for cfg in cands:
            if variant == "sym" and not quick and time.time() - t0 > budget_s and timed:
                break
            try:
                got = w4a16_gemv(x, w0, s0, zeros(0), GROUP, config=cfg).float()
                err = (got - ref).abs().max().item()
                if err > 2e-2 * ref.abs().max().item():
                    print(f"  {cfg.describe()}: wrong result (max error {err:.3g}), skipped")
                    continue
                us = timer(lambda i, cfg=cfg, zeros=zeros: w4a16_gemv(
                    x, ws[i][0], ws[i][1], zeros(i), GROUP, config=cfg), copies, calls)
            except Exception as e:  # noqa: BLE001 (e.g. out of shared memory for a large tile)
                print(f"  {cfg.describe()}: {type(e).__name__}: {str(e)[:120]}")
                continue
            timed.append((us, cfg))
        best_us, best_cfg = min(timed, key=lambda t: t[0])
        out[variant] = {"timed": timed, "old_us": old_us, "best_us": best_us, "best": best_cfg}
        gbps = q_bytes[variant] / best_us / 1e3
        print(f"{n:>6} x {k:<5} {variant:<4} cuBLAS bf16 {cublas_us:7.2f} us "
              f"({dense_bytes / cublas_us / 1e3:5.0f} GB/s) | old {old_us:7.2f} us "
              f"({q_bytes[variant] / old_us / 1e3:5.0f} GB/s) | new {best_us:7.2f} us "
              f"({gbps:5.0f} GB/s) {best_cfg.describe():<18} x{old_us / best_us:4.2f} vs old, "
              f"x{cublas_us / best_us:4.2f} vs bf16  [{len(timed)} tiles]", flush=True)
    # one tile for both: the fastest in sum among those timed with and without zeros
    asym_us = {c: us for us, c in out["asym"]["timed"]}
    sym_us = {c: us for us, c in out["sym"]["timed"]}
    cfg = min(asym_us, key=lambda c: sym_us[c] + asym_us[c])
    model = ",".join(users)
    record = {
        "workload": "w4gemv", "model": model, "load_format": "dummy", "backend": "llmaccel",
        "config": {"m": 1, "n": n, "k": k, "group_size": GROUP, "kernel": cfg.describe(),
                   "tiles_timed": len(out["sym"]["timed"])},
        "metric": "us", "value": round(sym_us[cfg], 2),
        "gbps": round(q_bytes["sym"] / sym_us[cfg] / 1e3, 1),
        "asym_us": round(asym_us[cfg], 2),
        "asym_gbps": round(q_bytes["asym"] / asym_us[cfg] / 1e3, 1),
        "old_us": round(out["sym"]["old_us"], 2), "old_asym_us": round(out["asym"]["old_us"], 2),
        "old_kernel": old_cfg.describe(), "cublas_bf16_us": round(cublas_us, 2),
        "cublas_bf16_gbps": round(dense_bytes / cublas_us / 1e3, 1),
        "speedup_vs_old": round(out["sym"]["old_us"] / sym_us[cfg], 2),
        "speedup_vs_bf16": round(cublas_us / sym_us[cfg], 2),
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__, "commit": current_commit(),
        "command": "python benchmarks/bench_w4_gemv.py" + (" --quick" if quick else ""),
    }
    entry = {"backend": "triton", "config": cfg.__dict__, "us": round(sym_us[cfg], 2),
             "us_asym": round(asym_us[cfg], 2), "model": model}
    return record, entry


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama-3.2-3b,llama-3.2-1b")
    ap.add_argument("--out-jsonl", default="w4gemv.jsonl")
    ap.add_argument("--out-table", default=None,
                    help="merge the best tiles into this tuning table ('auto': this GPU's)")
    ap.add_argument("--budget-s", type=float, default=160,
                    help="time for the whole symmetric tile sweep (shared out over the shapes); "
                         "with the rest a run takes about a minute more")
    ap.add_argument("--pdl", action="store_true",
                    help="launch the Triton kernels with programmatic dependent launch, as the "
                         "engine does on Hopper (off by default, like tune_gemm.py)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (interpreter)")
    args = ap.parse_args(argv)
    if args.quick and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    from llmaccel.kernels import pdl
    from llmaccel.kernels.gemm_tuning import write_table

    tg = _tune_gemm()
    if args.quick:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        shapes = {(40, 256): ["quick"], (72, 128): ["quick"]}
    else:
        dev = torch.device("cuda")
        shapes = {nk: users for nk, users in tg.linear_shapes(args.models.split(",")).items()
                  if not all(u.endswith("lm_head") for u in users)}
    if args.pdl:
        print(f"PDL {'on' if pdl.configure(dev, requested=True) else 'unsupported here: off'}")
    t0 = time.time()
    records, entries = [], {}
    for i, ((n, k), users) in enumerate(shapes.items()):
        # what is left of the budget, shared by the shapes still to run
        budget = (args.budget_s - (time.time() - t0)) / (len(shapes) - i)
        record, entry = bench_shape(n, k, users, dev, budget, tg, args.quick)
        record["config"]["pdl"] = pdl.enabled()
        records.append(record)
        if record["speedup_vs_old"] > 1:  # no measured win over the general kernel, no entry
            entries[f"w4gemv:1:{n}:{k}"] = entry
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    with open(args.out_jsonl, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    print("\n| layers | N | K | cuBLAS bf16 us | old us | new us | new GB/s | asym new us | "
          "tile | x old | x bf16 |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for r in records:
        c = r["config"]
        print(f"| {r['model']} | {c['n']} | {c['k']} | {r['cublas_bf16_us']:.2f} | "
              f"{r['old_us']:.2f} | {r['value']:.2f} | {r['gbps']:,.0f} | {r['asym_us']:.2f} | "
              f"{c['kernel']} | {r['speedup_vs_old']:.2f} | {r['speedup_vs_bf16']:.2f} |")
    if args.out_table:
        name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
        path = write_table(args.out_table, name, entries)
        print(f"{len(entries)} w4gemv entries -> {path}")
    print(f"done in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
