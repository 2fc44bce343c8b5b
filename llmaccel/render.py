"""Rich tables for what the CLI shows people (machines get --json instead)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

GIB = 1024 ** 3


def _n(x: float) -> str:
    return f"{x:,.0f}"


def render_analysis(name: str, a: dict[str, Any], console: Console) -> None:
    p, d = a["parameters"], a["dims"]
    console.print(f"[bold]{name}[/] — {a['architecture']}: {d['layers']} layers, hidden "
                  f"{d['hidden']}, {d['heads']} heads / {d['kv_heads']} KV heads × {d['head_dim']},"
                  f" intermediate {d['inter']}, vocab {d['vocab']:,}")

    t = Table(title="Parameters by module (per decoder layer, sorted)")
    for col in ("module", "per layer", f"× {p['layers']} layers", "share of total"):
        t.add_column(col, justify="left" if col == "module" else "right")
    for mod, n in p["per_layer"].items():
        t.add_row(mod, _n(n), _n(n * p["layers"]), f"{100 * n * p['layers'] / p['total']:.1f}%")
    t.add_section()
    t.add_row("all decoder layers", _n(p["total_layers"] // p["layers"]), _n(p["total_layers"]),
              f"{100 * p['total_layers'] / p['total']:.1f}%")
    for mod, n in p["other"].items():
        label = "lm_head (tied)" if mod == "lm_head" and p["tie_word_embeddings"] \
            else mod
        t.add_row(label, "", _n(n), f"{100 * n / p['total']:.1f}%")
    t.add_section()
    t.add_row("[bold]total[/]", "", f"[bold]{_n(p['total'])}[/]", "100.0%")
    console.print(t)

    m = Table(title="Weight memory (linear layers quantized; embeddings, head, norms 16-bit)")
    m.add_column("format")
    m.add_column("weights GiB", justify="right")
    m.add_column("GB", justify="right")
    m.add_column("read per decode step GB", justify="right")
    for fmt, b in a["weight_memory_bytes"].items():
        m.add_row(fmt, f"{b / GIB:.2f}", f"{b / 1e9:.2f}",
                  f"{a['decode_bytes_per_token'][fmt] / 1e9:.2f}")
    console.print(m)

    kv = a["kv_cache"]
    console.print(f"KV cache: {_n(kv['bytes_per_token_bf16'])} bytes per token (bf16), "
                  f"{kv['bytes_per_request_bf16'] / 2**20:.1f} MiB per {kv['tokens_per_request']:,}"
                  f"-token request; half that with an FP8 KV cache.")

    r = a["roofline"]
    ctx = r["context_tokens"]
    title = "Batch-1 decode roofline, tok/s = bandwidth / bytes read per token (" + (
        f"weights + KV of {ctx:,} tokens)" if ctx else "weights only)")
    rt = Table(title=title)
    rt.add_column("GPU")
    rt.add_column("GB/s", justify="right")
    for fmt in a["weight_memory_bytes"]:
        rt.add_column(fmt, justify="right")
    for gpu, row in r["tok_s"].items():
        rt.add_row(gpu, _n(r["bandwidth_gbps"][gpu]), *(f"{v:,.0f}" for v in row.values()))
    console.print(rt)
