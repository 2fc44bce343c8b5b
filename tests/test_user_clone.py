"""The project on a user's clone: no ../shared beside it, no WikiText anywhere, the Hub out of
reach. The commands that need text say so in one line naming --data before any work; those that
need none (RTN, FP8) never ask; a GGUF model quantizes into safetensors; the recipe keys its
stages on the text's content and marks every figure fresh or cached."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from cli_helpers import cli_env, llmaccel_exe, one_line_error
from conftest import generated_text


@pytest.fixture
def no_data_env(tmp_path) -> dict[str, str]:
    """The environment of a clone without ../shared, offline, with an empty cache for data
    (models still come from the usual cache)."""
    empty = tmp_path / "empty-data"
    empty.mkdir()
    return dict(cli_env(), LLMACCEL_DATA_DIR=str(empty), LLMACCEL_NO_SHARED_DATA="1",
                HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")


def _run(env: dict[str, str], *args: str, cwd: Path | None = None
         ) -> subprocess.CompletedProcess:
    return subprocess.run([llmaccel_exe(), *args], capture_output=True, text=True, env=env,
                          timeout=600, cwd=cwd)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from server_harness import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("tiny"))


def test_run_without_data_stops_before_any_stage_naming_data(no_data_env, tiny_model,
                                                            tmp_path):
    runs = tmp_path / "runs"
    t0 = time.perf_counter()
    r = _run(no_data_env, "run", "--model", str(tiny_model), "--runs-dir", str(runs))
    line = one_line_error(r)
    assert "--data" in line and "WikiText-2" in line and "unreachable" in line
    assert time.perf_counter() - t0 < 60
    # nothing ran: no stage directory, no model analysed or fine-tuned first
    assert not runs.exists() or not any(p.is_dir() for p in (runs / "default-small").glob("*"))


def test_eval_ppl_and_gptq_without_data_are_one_line_naming_data(no_data_env, tiny_model,
                                                                 tmp_path):
    for args in (("eval", "ppl", str(tiny_model), "--device", "cpu"),
                 ("quantize", str(tiny_model), "--method", "gptq", "--out",
                  str(tmp_path / "q"))):
        line = one_line_error(_run(no_data_env, *args))
        assert "--data" in line, line
    assert not (tmp_path / "q").exists()


def test_rtn_and_fp8_never_ask_for_text(no_data_env, tiny_model, tmp_path):
    for method in ("rtn", "fp8"):
        out = tmp_path / method
        r = _run(no_data_env, "quantize", str(tiny_model), "--method", method, "--group-size",
                 "-1", "--out", str(out), "--device", "cpu")
        assert r.returncode == 0, r.stderr
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"


def test_eval_ppl_reads_a_text_file_given_with_data(no_data_env, tiny_model, tmp_path):
    text = tmp_path / "mine.txt"
    text.write_text(generated_text(40))
    r = _run(no_data_env, "eval", "ppl", str(tiny_model), "--device", "cpu", "--context", "32",
             "--limit", "2", "--data", str(text), "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["windows"] == 2 and res["ppl"] > 1 and res["data"] == str(text)


def test_quantize_takes_the_default_model_format_gguf(no_data_env, smollm2_gguf, tmp_path):
    out = tmp_path / "rtn8"
    r = _run(no_data_env, "quantize", str(smollm2_gguf), "--method", "rtn", "--bits", "8",
             "--group-size", "-1", "--out", str(out), "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "GGUF file" in r.stdout and "safetensors" in r.stdout
    assert list(out.glob("*.safetensors")) and (out / "tokenizer.json").is_file()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"


def test_tests_do_not_need_the_venv_on_path():
    env = dict(os.environ, PATH="/usr/bin:/bin")
    r = subprocess.run([llmaccel_exe(), "--version"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.startswith("llmaccel ")


# -- the recipe: keyed on the text, fresh or cached in the report ------------------------------
RECIPE = """\
name: t
model: {model}
data: {data}
stages:
  quantize:
    methods: [rtn-int8, gptq-int4-g128]
  eval:
    context: 64
    limit: 2
"""


def _plan(tmp_path: Path, model: Path, data: Path):
    from llmaccel.pipeline.recipe import parse_recipe
    from llmaccel.pipeline.runner import make_plan

    return make_plan(parse_recipe(RECIPE.format(model=model, data=data)), tmp_path / "runs")


def test_a_stage_key_follows_the_text_it_reads(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "text.txt"
    data.write_text(generated_text(20))
    before = {s.name: s.key for s in _plan(tmp_path, model, data).stages}
    data.write_text(generated_text(20, seed=5))  # same path, new text
    after = {s.name: s.key for s in _plan(tmp_path, model, data).stages}
    changed = {n for n in before if before[n] != after[n]}
    # GPTQ calibrates on the text, perplexity measures on it; RTN reads none
    assert changed == {"quantize.gptq-int4-g128", "eval.base", "eval.gptq-int4-g128",
                       "eval.rtn-int8"}


def test_the_plan_finds_every_text_before_running(tmp_path, monkeypatch):
    from llmaccel.pipeline.recipe import RecipeError

    monkeypatch.setenv("LLMACCEL_NO_SHARED_DATA", "1")
    monkeypatch.setenv("LLMACCEL_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("LLMACCEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(RecipeError,
                       match=r"stage quantize.gptq-int4-g128: WikiText-2 \(validation split\) "
                             "not found"):
        _plan(tmp_path, model, "wikitext2")


def test_report_marks_each_figure_fresh_or_cached(tmp_path):
    from llmaccel.pipeline.report import made_label
    from llmaccel.pipeline.stages import StageInputs

    inputs = StageInputs(source="m", run_id="run-2")
    for role, made_by in (("eval.base", "run-2"), ("bench.base.latency", "run-1"),
                          ("eval.fp8", "run-1")):
        inputs.dirs[role] = tmp_path
        inputs.made_by[role] = made_by
    assert made_label(inputs, ["eval.base"]) == "fresh"
    assert made_label(inputs, ["eval.fp8"]) == "cached: run run-1"
    assert made_label(inputs, ["eval.base", "bench.base.latency"]) == \
        "cached: run run-1 (the rest fresh)"


def test_the_plan_checks_the_model_before_running(tmp_path, wikitext_dir):
    from llmaccel.errors import ModelNotFoundError
    from llmaccel.pipeline.recipe import parse_recipe
    from llmaccel.pipeline.runner import make_plan

    text = RECIPE.format(model=tmp_path / "no-such-model", data=wikitext_dir)
    with pytest.raises(ModelNotFoundError, match="no such file or directory: .*no-such-model"):
        make_plan(parse_recipe(text), tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


def test_an_error_shows_its_brackets(no_data_env, tiny_model):
    """Rich would read "[weird]" in a message as markup and drop it."""
    line = one_line_error(_run(no_data_env, "eval", "ppl", str(tiny_model), "--device", "cpu",
                               "--data", "[weird]/nope.txt"))
    assert line == "error: no such file or directory: [weird]/nope.txt", line
