"""Bad input to the `llmaccel` command: a clear one-line `error:` on stderr, a non-zero exit
code and no Python traceback.

The real console command runs in subprocesses with HF_HUB_OFFLINE=1. Each one spends ~5 s
importing torch + transformers, so every run of this module is started at module setup (a
few at a time) and each test waits for the result it needs.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from cli_helpers import WORKERS, one_line_error, run_llmaccel

FETCH = Path(__file__).resolve().parents[1].parent / "shared/models/fetch"
SHAPE_NAMES = ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "qwen2.5-0.5b", "qwen2.5-1.5b",
               "smollm2-135m")

_WORKERS = WORKERS

# ---------------------------------------------------------------------------------------------
# Inputs, built once per module
# ---------------------------------------------------------------------------------------------

TINY = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2)


def _write_tiny_model(directory: Path) -> None:
    """A valid tiny Llama checkpoint (config.json, model.safetensors) with a word-level
    tokenizer, so that `generate` on it succeeds."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY))
    model.save_pretrained(directory)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 100)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                         bos_token="<s>", eos_token="</s>"
                                         ).save_pretrained(directory)


def _fetch_gguf() -> tuple[Path | None, str | None]:
    """(path of the real SmolLM2 GGUF, None) or (None, why not)."""
    if not FETCH.is_file():
        return None, f"skip: {FETCH} does not exist"
    r = subprocess.run(["bash", str(FETCH), "smollm2-135m-instruct"], capture_output=True,
                       text=True, timeout=600)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines or not Path(lines[-1]).is_file():
        return None, f"fail: {FETCH} smollm2-135m-instruct failed: {r.stdout}{r.stderr}"
    return Path(lines[-1]), None


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("cli_errors")
    d: dict = {}

    tiny = root / "tiny"
    _write_tiny_model(tiny)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in
                                                                       tiny.iterdir()}
    d["tiny"] = tiny

    bad_json = root / "bad_json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], '
                                          '"hidden_size": ')
    d["bad_json"] = bad_json

    gpt2 = root / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], '
                                      '"model_type": "gpt2"}')
    d["gpt2"] = gpt2

    # Same checkpoint as `tiny` (which loads), with only model.safetensors damaged.
    trunc = root / "truncated_safetensors"
    shutil.copytree(tiny, trunc)
    blob = (tiny / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    d["truncated_safetensors"] = trunc

    garbage = root / "garbage_safetensors"
    shutil.copytree(tiny, garbage)
    header = b"this is not JSON, just garbage!"
    (garbage / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header
                                                + bytes(4096))
    d["garbage_safetensors"] = garbage

    gguf, why_not = _fetch_gguf()
    d["gguf_problem"] = why_not
    if gguf is not None:
        gdir = root / "gguf_1mib"
        gdir.mkdir()
        with open(gguf, "rb") as f:
            (gdir / "model.gguf").write_bytes(f.read(1 << 20))  # inside the metadata
        d["gguf_1mib"] = gdir / "model.gguf"
        gdir = root / "gguf_half"
        gdir.mkdir()
        size = gguf.stat().st_size
        with open(gguf, "rb") as f:  # whole metadata, half the tensor data
            (gdir / "model.gguf").write_bytes(f.read(size // 2))
        d["gguf_half"] = gdir / "model.gguf"
    return d


def _generate(model: str, *extra: str) -> tuple[str, ...]:
    return ("generate", model, "--max-tokens", "2", *extra)


@pytest.fixture(scope="module")
def runs(inputs):
    """Every CLI run of this module, started at once; tests call `.result()` on theirs."""
    models = {
        "missing_path": "/nonexistent/model-dir",
        "bad_json": str(inputs["bad_json"]),
        "unsupported": str(inputs["gpt2"]),
        "truncated_safetensors": str(inputs["truncated_safetensors"]),
        "garbage_safetensors": str(inputs["garbage_safetensors"]),
        "unknown_name": "not-a-model",
        "hub_offline": "some-org/some-model",
    }
    if "gguf_1mib" in inputs:
        models["gguf_1mib"] = str(inputs["gguf_1mib"])
        models["gguf_half"] = str(inputs["gguf_half"])
    commands: dict[tuple[str, str], tuple[str, ...]] = {}
    for case, model in models.items():
        commands["generate", case] = _generate(model)
    for case in ("missing_path", "bad_json", "unsupported", "unknown_name", "hub_offline",
                 "gguf_1mib"):
        if case in models:
            commands["analyze", case] = ("analyze", models[case])
    commands["generate", "max_model_len"] = _generate(str(inputs["tiny"]), "--max-model-len",
                                                       "999999999")
    commands["generate", "capture_sizes"] = _generate(
        str(inputs["tiny"]), "--cudagraph-capture-sizes", "1,two")
    commands["generate", "backend"] = _generate(str(inputs["tiny"]), "--attention-backend",
                                                "fastest")
    commands["generate", "tiny_ok"] = _generate(str(inputs["tiny"]), "--prompt", "w5 w6")
    commands["generate", "relative_typo"] = _generate("models/no-such-model")
    commands["generate", "tokenizer_path_typo"] = _generate(
        str(inputs["tiny"]), "--tokenizer", "./no-such-tokenizer")
    commands["generate", "tokenizer_dir_typo"] = _generate(
        str(inputs["tiny"]), "--tokenizer", "tokenizers/no-such-one")
    commands["generate", "spec_ok"] = _generate(
        str(inputs["tiny"]), "--prompt", "w5 w6 w5 w6 w5", "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 2}')
    for case, value in (("spec_json", "{method: ngram"), ("spec_field", '{"methd": "ngram"}'),
                        ("spec_value", '{"method": "ngram", "num_speculative_tokens": 0}'),
                        ("spec_draft", '{"method": "draft", "model": "/nonexistent/draft"}')):
        commands["generate", case] = _generate(str(inputs["tiny"]), "--speculative-config",
                                               value)
    with ThreadPoolExecutor(_WORKERS) as pool:
        futures: dict[tuple[str, str], Future] = {
            key: pool.submit(run_llmaccel, *argv) for key, argv in commands.items()}
        yield futures


def _result(runs, command: str, case: str) -> subprocess.CompletedProcess:
    return runs[command, case].result()


# ---------------------------------------------------------------------------------------------
# The cases
# ---------------------------------------------------------------------------------------------

BOTH = pytest.mark.parametrize("command", ["generate", "analyze"])


def test_tiny_model_generates(runs):
    """Control: the undamaged tiny checkpoint works, so the failures below come from the
    damage done to each input."""
    r = _result(runs, "generate", "tiny_ok")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert "2 tokens" in r.stdout


@BOTH
def test_nonexistent_path(runs, command):
    line = one_line_error(_result(runs, command, "missing_path"))
    assert "error: no such file or directory: /nonexistent/model-dir" in line


@pytest.mark.parametrize("case, name", [
    ("relative_typo", "models/no-such-model"),
    ("tokenizer_path_typo", "./no-such-tokenizer"),
    ("tokenizer_dir_typo", "tokenizers/no-such-one")])
def test_a_mistyped_path_is_a_path_error_before_a_hub_error(runs, case, name):
    line = one_line_error(_result(runs, "generate", case))
    assert line.startswith(f"error: no such file or directory: {name}"), line


@BOTH
def test_corrupt_config_json(runs, inputs, command):
    line = one_line_error(_result(runs, command, "bad_json"))
    assert "config.json" in line
    assert str(inputs["bad_json"].resolve() / "config.json") in line
    assert "JSON" in line


@BOTH
def test_unsupported_architecture(runs, command):
    line = one_line_error(_result(runs, command, "unsupported"))
    assert "GPT2LMHeadModel" in line
    assert "not support" in line


@pytest.mark.parametrize("case", ["truncated_safetensors", "garbage_safetensors"])
def test_damaged_safetensors(runs, inputs, case):
    line = one_line_error(_result(runs, "generate", case))
    assert "corrupt" in line or "truncated" in line
    assert str(inputs[case].resolve() / "model.safetensors") in line


def _gguf_case(runs, inputs, command: str, case: str) -> str:
    problem = inputs["gguf_problem"]
    if problem is not None:
        if problem.startswith("skip:"):
            pytest.skip(problem)
        pytest.fail(problem)
    line = one_line_error(_result(runs, command, case))
    assert "GGUF" in line
    assert "corrupt" in line or "truncated" in line
    assert str(inputs[case].resolve()) in line
    return line


@BOTH
def test_gguf_truncated_in_metadata(runs, inputs, command):
    _gguf_case(runs, inputs, command, "gguf_1mib")


def test_gguf_truncated_in_tensor_data(runs, inputs):
    _gguf_case(runs, inputs, "generate", "gguf_half")


@BOTH
def test_unknown_model_name_lists_shapes(runs, command):
    line = one_line_error(_result(runs, command, "unknown_name"))
    assert "not-a-model" in line
    for name in SHAPE_NAMES:
        assert name in line, name


@BOTH
def test_hub_id_offline(runs, command):
    line = one_line_error(_result(runs, command, "hub_offline"))
    assert "some-org/some-model" in line
    assert "reach" in line and "Hub" in line
    assert "local path" in line


def test_max_model_len_out_of_range(runs):
    line = one_line_error(_result(runs, "generate", "max_model_len"))
    assert "999999999" in line
    assert "max_model_len" in line or "max-model-len" in line
    assert "2048" in line  # the tiny model's max_position_embeddings: the allowed maximum


def test_bad_engine_flags(runs):
    line = one_line_error(_result(runs, "generate", "capture_sizes"))
    assert "--cudagraph-capture-sizes" in line and "1,two" in line
    line = one_line_error(_result(runs, "generate", "backend"))
    assert "fastest" in line and "triton" in line


def test_speculative_config_flag(runs):
    r = _result(runs, "generate", "spec_ok")
    assert r.returncode == 0, r.stderr
    assert "speculative: acceptance" in r.stdout
    line = one_line_error(_result(runs, "generate", "spec_json"))
    assert "--speculative-config" in line and "JSON" in line
    line = one_line_error(_result(runs, "generate", "spec_field"))
    assert "methd" in line and "num_speculative_tokens" in line
    line = one_line_error(_result(runs, "generate", "spec_value"))
    assert "num_speculative_tokens must be >= 1" in line
    line = one_line_error(_result(runs, "generate", "spec_draft"))
    assert "/nonexistent/draft" in line
