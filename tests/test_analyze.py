"""`llmaccel.analyze` and `llmaccel analyze`: parameter counts checked against hand arithmetic
and against real transformers models, weight / KV-cache bytes against BENCHMARKS.md, the decode
roofline, and the table output.

The CLI is run as the real console command in subprocesses. Each one spends ~5 s importing
torch + transformers, so all CLI runs of this module are started together at module setup (a
few at a time) and each test waits for the result it needs.
"""

from __future__ import annotations

import json
import re
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from cli_helpers import WORKERS, one_line_error, run_llmaccel
import transformers

from llmaccel.analyze import parameter_counts

_WORKERS = WORKERS

RUNS: dict[str, tuple[str, ...]] = {
    "3b_json_bw1000": ("analyze", "llama-3.2-3b", "--json", "--bandwidth", "1000"),
    "1b_json": ("analyze", "llama-3.2-1b", "--json"),
    "3b_json_h200": ("analyze", "llama-3.2-3b", "--json", "--gpu", "h200"),
    "3b_json_h100_sxm": ("analyze", "llama-3.2-3b", "--json", "--gpu", "H100 SXM"),
    "3b_table": ("analyze", "llama-3.2-3b"),
    "bad_gpu": ("analyze", "llama-3.2-3b", "--gpu", "NoSuchGPU-9000"),
    "bw_zero": ("analyze", "llama-3.2-3b", "--bandwidth", "0"),
}


@pytest.fixture(scope="module")
def runs():
    """All CLI runs of this module, started at once; tests call `.result()` on theirs."""
    with ThreadPoolExecutor(_WORKERS) as pool:
        futures: dict[str, Future] = {k: pool.submit(run_llmaccel, *a) for k, a in RUNS.items()}
        yield futures


def _ok_json(r: subprocess.CompletedProcess) -> dict:
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    return json.loads(r.stdout)


# ---------------------------------------------------------------------------------------------
# parameter_counts on tiny hand-written configs
# ---------------------------------------------------------------------------------------------

TINY = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2)

# hidden 32, 4 heads -> head_dim 8; 2 KV heads -> k/v out = 2 * 8 = 16.
HAND_PER_LAYER = {
    "q_proj": 32 * 32,
    "k_proj": 32 * 16,
    "v_proj": 32 * 16,
    "o_proj": 32 * 32,
    "gate_proj": 32 * 48,
    "up_proj": 32 * 48,
    "down_proj": 48 * 32,
    "input_layernorm": 32,
    "post_attention_layernorm": 32,
}
HAND_LAYER_TOTAL = 1024 + 512 + 512 + 1024 + 1536 + 1536 + 1536 + 32 + 32  # 7744
HAND_EMBED = 100 * 32


def _llama(tied: bool) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(**TINY, tie_word_embeddings=tied)


def _qwen2(tied: bool) -> transformers.Qwen2Config:
    return transformers.Qwen2Config(**TINY, tie_word_embeddings=tied)


def test_hand_count_matches_literal_arithmetic():
    assert sum(HAND_PER_LAYER.values()) == HAND_LAYER_TOTAL == 7744


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_parameter_counts_llama_by_hand(tied):
    counts = parameter_counts(_llama(tied))
    assert counts["layers"] == 3
    assert counts["tie_word_embeddings"] is tied
    assert counts["per_layer"] == HAND_PER_LAYER
    assert counts["total_layers"] == 3 * 7744
    assert counts["other"] == {"embed_tokens": 3200, "lm_head": 0 if tied else 3200, "norm": 32}
    expected_total = 3 * 7744 + 3200 + 32 + (0 if tied else 3200)
    assert expected_total == (26464 if tied else 29664)
    assert counts["total"] == expected_total


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_parameter_counts_qwen2_by_hand(tied):
    # Qwen2 adds biases to q, k and v (not o, not the MLP).
    counts = parameter_counts(_qwen2(tied))
    expected = dict(HAND_PER_LAYER, q_proj=32 * 32 + 32, k_proj=32 * 16 + 16,
                    v_proj=32 * 16 + 16)
    assert counts["per_layer"] == expected
    assert counts["total"] == 3 * (7744 + 64) + 3200 + 32 + (0 if tied else 3200)


@pytest.mark.parametrize("make_config,tied", [
    (_llama, False), (_llama, True), (_qwen2, False), (_qwen2, True),
], ids=["llama-untied", "llama-tied", "qwen2-untied", "qwen2-tied"])
def test_parameter_counts_match_transformers_model(make_config, tied):
    cfg = make_config(tied)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    # The model really is tied / untied as configured (so the comparison covers both cases).
    same = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert same is tied
    counts = parameter_counts(cfg)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    # Module by module, from the parameter names of decoder layer 0.
    layer0 = {name.removeprefix("model.layers.0."): p.numel()
              for name, p in model.named_parameters() if name.startswith("model.layers.0.")}
    for module, n in counts["per_layer"].items():
        real = sum(v for k, v in layer0.items() if k.split(".")[-2] == module)
        assert n == real, module
    assert sum(counts["per_layer"].values()) == sum(layer0.values())


# ---------------------------------------------------------------------------------------------
# `llmaccel analyze` on the benchmark shapes
# ---------------------------------------------------------------------------------------------


def test_cli_3b_per_layer_counts(runs):
    data = _ok_json(runs["3b_json_bw1000"].result())
    assert data["model"] == "llama-3.2-3b"
    per = data["parameters"]["per_layer"]
    # hidden 3072, 24 heads x 128, 8 KV heads x 128, intermediate 8192
    assert per["gate_proj"] == per["up_proj"] == per["down_proj"] == 3072 * 8192
    assert per["q_proj"] == per["o_proj"] == 3072 * 3072
    assert per["k_proj"] == per["v_proj"] == 3072 * 1024
    assert per["gate_proj"] > per["q_proj"] > per["k_proj"]
    assert data["parameters"]["tie_word_embeddings"] is True
    assert data["parameters"]["other"]["lm_head"] == 0


def test_cli_3b_weight_and_kv_bytes(runs):
    data = _ok_json(runs["3b_json_bw1000"].result())
    assert abs(data["weight_memory_bytes"]["bf16"] / 1e9 - 6.43) <= 0.01  # BENCHMARKS.md
    assert data["kv_cache"]["bytes_per_token_bf16"] == 2 * 28 * 8 * 128 * 2 == 114688


def test_cli_1b_weight_bytes(runs):
    data = _ok_json(runs["1b_json"].result())
    assert data["model"] == "llama-3.2-1b"
    assert abs(data["weight_memory_bytes"]["bf16"] / 1e9 - 2.47) <= 0.01  # BENCHMARKS.md


def test_cli_roofline_with_bandwidth(runs):
    data = _ok_json(runs["3b_json_bw1000"].result())
    roof = data["roofline"]
    assert list(roof["bandwidth_gbps"].values()) == [1000.0]
    (row,) = roof["tok_s"].values()
    decode = data["decode_bytes_per_token"]
    assert set(row) == set(decode) >= {"bf16", "int8", "int4-g128", "fp8"}
    for fmt, tok_s in row.items():
        assert tok_s == pytest.approx(1000e9 / decode[fmt], rel=1e-9), fmt
    # Tied 3B model: every bf16 weight byte is read per token, so 1000 GB/s / ~6.43 GB.
    assert row["bf16"] == pytest.approx(1000 / 6.43, rel=2e-3)
    # Fewer bytes per weight, more tokens per second.
    assert row["bf16"] < row["int8"] < row["int4-g128"]


@pytest.mark.parametrize("key,name,gbps", [
    ("3b_json_h200", "H200", 4800.0),
    ("3b_json_h100_sxm", "H100 SXM", 3350.0),
])
def test_cli_gpu_names_resolve(runs, key, name, gbps):
    data = _ok_json(runs[key].result())
    roof = data["roofline"]
    assert roof["bandwidth_gbps"] == {name: gbps}
    assert list(roof["tok_s"]) == [name]
    bf16 = data["decode_bytes_per_token"]["bf16"]
    assert roof["tok_s"][name]["bf16"] == pytest.approx(gbps * 1e9 / bf16, rel=1e-9)


def test_cli_unknown_gpu_isone_line_error(runs):
    line = one_line_error(runs["bad_gpu"].result())
    assert "NoSuchGPU-9000" in line
    assert "H200" in line  # lists the known ones


def test_cli_zero_bandwidth_isone_line_error(runs):
    line = one_line_error(runs["bw_zero"].result())
    assert "--bandwidth" in line
    assert "positive" in line


def test_cli_table_orders_modules_by_size(runs):
    r = runs["3b_table"].result()
    assert r.returncode == 0, r.stderr
    out = r.stdout
    order = ["gate_proj", "up_proj", "down_proj", "q_proj", "o_proj", "k_proj", "v_proj"]
    positions = []
    for name in order:
        hits = [m.start() for m in re.finditer(rf"\b{name}\b", out)]
        assert len(hits) == 1, (name, hits)
        positions.append(hits[0])
    assert positions == sorted(positions), dict(zip(order, positions))
    # They sit in the parameter table, which comes before the memory table.
    assert positions[-1] < out.index("Weight memory")
