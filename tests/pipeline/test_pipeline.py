"""Recipes (`llmaccel run`): the schema's errors, the cache (hits, invalidation by a config
value or an input's bytes), failures stopping only their readers, stage selection; stage
functions are fakes here that record their calls, except in the end-to-end test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmaccel.pipeline.recipe import RecipeError, parse_recipe
from llmaccel.pipeline.runner import execute, make_plan

RECIPE = """\
name: t
model: {model}
data: {data}
stages:
  analyze: {{}}
  finetune:
    steps: 3
  quantize:
    methods: [rtn-int8, fp8]
  eval:
    context: 64
    limit: 2
"""


# -- schema ------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("name: x\nstages:\n  quantize:\n    methods: [rtn-int8, int3]\n",
     "line 4: stages.quantize.methods: unknown scheme 'int3'"),
    ("name: x\nstages:\n  finetune:\n    stepz: 3\n", "line 4: stages.finetune.stepz: unknown key"),
    ("name: x\nstages:\n  eval:\n    context: many\n", "line 4: stages.eval.context: "),
    ("name: x\nstages:\n  eval:\n    limit: 0\n", "line 4: stages.eval.limit: "),
    ("name: x\ndevice: tpu\n", "line 2: device: "),
    ("name: a/b\n", "line 1: name: letters, digits"),
    ("name: x\nstages:\n  serve: {}\n", "line 3: stages.serve: unknown key"),
    ("name: x\nstages:\n  bench:\n    backends: [vllm]\n", "line 4: stages.bench.backends.0: "),
    ("name: x\nstages:\n  quantize: {methods: [fp8]}\n  bench:\n    workloads: [latency]\n"
     "    serve_variants: [base, gptq-int4-g128]\n",
     "line 6: stages.bench.serve_variants: 'gptq-int4-g128' is not a variant of this recipe "
     "(variants: base, fp8)"),
    ("name: x\nstages:\n  draft:\n    variants: [finetuned]\n",
     "line 4: stages.draft.variants: 'finetuned' is not a variant of this recipe "
     "(variants: base)"),
    ("name: x\nstages:\n  draft:\n    disable_by_batch_size: {ngram: 0}\n",
     "line 4: stages.draft.disable_by_batch_size: "),
    ("name: x\nstages:\n  draft:\n    disable_by_batch_size: {eagle: 4}\n",
     "line 4: stages.draft.disable_by_batch_size.eagle"),
    ("name: [x\n", "not valid YAML"),
    ("- a\n- b\n", "a recipe is a mapping"),
])
def test_schema_errors_name_the_key_and_line(text, expected):
    with pytest.raises(RecipeError) as err:
        parse_recipe(text, "r.yaml")
    assert str(err.value).startswith("r.yaml:") and expected in str(err.value)


def test_defaults_and_an_empty_recipe():
    r = parse_recipe("")
    assert r.name == "default" and r.model is None and r.stages.quantize is None
    r = parse_recipe("stages:\n  quantize: {}\n")
    assert "gptq-int4-g128" in r.stages.quantize.methods


def test_bench_variant_lists_narrow_each_variants_own_config():
    from llmaccel.pipeline.dag import build_graph
    from llmaccel.pipeline.recipe import default_recipe

    r = parse_recipe("stages:\n  finetune: {}\n  quantize: {methods: [fp8]}\n  bench:\n"
                     "    serve_variants: [fp8]\n")
    bench = {n.name: n.config["backends"] for n in build_graph(r, "m") if n.kind == "bench"}
    assert bench == {"bench.base.latency": ["llmaccel", "hf-eager"],
                     "bench.base.throughput": ["llmaccel", "hf-cb"],
                     "bench.finetuned.latency": ["llmaccel"],
                     "bench.finetuned.throughput": ["llmaccel"],
                     "bench.fp8.latency": ["llmaccel"], "bench.fp8.throughput": ["llmaccel"],
                     "bench.fp8.serve": ["llmaccel"]}
    r = parse_recipe("stages:\n  quantize: {methods: [fp8]}\n  draft:\n"
                     "    methods: [ngram, head]\n    variants: [base, fp8]\n")
    spec = {n.name: (n.inputs, n.config.get("scheme")) for n in build_graph(r, "m")
            if n.kind == "spec"}
    assert spec == {"spec.ngram.base": ({"model": "model"}, None),
                    "spec.ngram.fp8": ({"model": "quantize.fp8"}, "fp8"),
                    "spec.head.base": ({"model": "model", "draft": "draft.head"}, None),
                    "spec.head.fp8": ({"model": "quantize.fp8", "draft": "draft.head"}, "fp8")}
    # a configured crossover reaches its method's runs only (the others keep their keys)
    r = parse_recipe("stages:\n  draft:\n    methods: [ngram, head]\n"
                     "    disable_by_batch_size: {ngram: 64}\n")
    limits = {n.name: n.config.get("disable_by_batch_size") for n in build_graph(r, "m")
              if n.kind == "spec"}
    assert limits == {"spec.ngram": 64, "spec.head": None}
    from llmaccel.pipeline.dag import W5_HARNESS  # runs of an older W5 harness are not reused
    assert {n.config["harness"] for n in build_graph(r, "m") if n.kind == "spec"} == \
        {W5_HARNESS}
    # the full built-in recipe: every stage, W3 and the HF baselines on the base model only
    nodes = {n.name: n for n in build_graph(default_recipe("full"), "m.gguf")}
    runs = [k for k in nodes if k.startswith("bench.")]
    assert len(runs) == 7 * 2 + 1 and "bench.base.serve" in runs
    assert nodes["bench.base.serve"].config["request_rates"] == [1.0, 4.0, 16.0, 64.0]
    assert "request_rates" not in nodes["bench.base.latency"].config
    assert {"draft.head", "spec.ngram", "spec.head", "report"} <= set(nodes)


# -- cache, with fake stages -------------------------------------------------------------------
class FakeStages:
    """Stage functions that write a file, record their calls and can be told to fail."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.fail: set[str] = set()

    def fns(self):
        def make(kind):
            def fn(node, inputs, out: Path):
                self.calls.append(node.name)
                if node.name in self.fail:
                    raise RuntimeError(f"{node.name} broke")
                (out / "out.txt").write_text(f"{node.name} from {inputs.models.get('model')}")
                manifest = {"model": "."} if kind in ("finetune", "quantize", "convert") else {}
                if kind == "eval":
                    manifest["ppl"] = 10.0
                return manifest
            return fn
        return {k: make(k) for k in ("analyze", "convert", "finetune", "quantize", "eval",
                                     "bench", "draft_head", "spec", "report")}


@pytest.fixture
def setup(tmp_path, wikitext_dir):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"a": 1}')
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(RECIPE.format(model=model, data=wikitext_dir))
    return model, recipe_file, tmp_path / "runs", FakeStages()


def run_once(recipe_text: str, runs: Path, fake: FakeStages, **kw):
    fake.calls.clear()
    plan = make_plan(parse_recipe(recipe_text), runs, **kw)
    return execute(plan, stage_fns=fake.fns())


ALL = ["analyze", "finetune", "quantize.rtn-int8", "quantize.fp8", "eval.base",
       "eval.finetuned", "eval.rtn-int8", "eval.fp8"]


def test_second_run_is_all_cached(setup):
    model, recipe_file, runs, fake = setup
    text = recipe_file.read_text()
    plan = run_once(text, runs, fake)
    assert fake.calls == ALL and all(s.status == "ran" for s in plan.stages)
    # inputs flow: eval.fp8 read the fp8 checkpoint, which read the finetuned model
    q = plan.by_name()["quantize.fp8"]
    out = plan.store.stage_dir("quantize.fp8", q.key)
    assert (out / "out.txt").read_text().endswith(
        str(plan.store.stage_dir("finetune", plan.by_name()["finetune"].key) / "."))
    plan = run_once(text, runs, fake)
    assert fake.calls == [] and all(s.status == "cached" for s in plan.stages)
    summary = json.loads((runs / "t" / "run.json").read_text())
    assert [s["status"] for s in summary["stages"]] == ["cached"] * len(ALL)


def test_a_config_value_reruns_that_stage_and_its_readers_only(setup):
    model, recipe_file, runs, fake = setup
    text = recipe_file.read_text()
    run_once(text, runs, fake)
    run_once(text.replace("limit: 2", "limit: 3"), runs, fake)
    assert fake.calls == ["eval.base", "eval.finetuned", "eval.rtn-int8", "eval.fp8"]
    run_once(text.replace("steps: 3", "steps: 4"), runs, fake)  # everything downstream
    assert fake.calls == ["finetune", "quantize.rtn-int8", "quantize.fp8", "eval.finetuned",
                          "eval.rtn-int8", "eval.fp8"]
    run_once(text.replace("[rtn-int8, fp8]", "[rtn-int8, fp8, rtn-int4-g128]"), runs, fake)
    assert fake.calls == ["quantize.rtn-int4-g128", "eval.rtn-int4-g128"]
    run_once(text, runs, fake)  # back to the first config: its outputs are still there
    assert fake.calls == []


def test_changed_model_bytes_rerun_everything(setup):
    model, recipe_file, runs, fake = setup
    text = recipe_file.read_text()
    run_once(text, runs, fake)
    (model / "config.json").write_text('{"a": 2}')
    run_once(text, runs, fake)
    assert fake.calls == ALL
    (model / "extra.bin").write_bytes(b"x")  # a new file counts too
    run_once(text, runs, fake)
    assert fake.calls == ALL


def test_a_failed_stage_stops_its_readers_and_keeps_the_rest(setup):
    model, recipe_file, runs, fake = setup
    text = recipe_file.read_text()
    fake.fail = {"quantize.rtn-int8"}
    plan = run_once(text, runs, fake)
    by = plan.by_name()
    assert by["quantize.rtn-int8"].status == "failed"
    assert "RuntimeError: quantize.rtn-int8 broke" in by["quantize.rtn-int8"].message
    assert by["eval.rtn-int8"].status == "skipped"
    assert "quantize.rtn-int8 failed" in by["eval.rtn-int8"].message
    assert "eval.rtn-int8" not in fake.calls
    assert all(by[n].status == "ran" for n in ALL if "rtn-int8" not in n)
    assert (runs / "t" / "quantize.rtn-int8.error.log").is_file()
    assert not list((runs / "t").glob(".tmp-*"))  # no half-written outputs left
    fake.fail = set()
    run_once(text, runs, fake)  # fixed: only the failed stage and its reader run
    assert fake.calls == ["quantize.rtn-int8", "eval.rtn-int8"]
    assert not (runs / "t" / "quantize.rtn-int8.error.log").exists()


def test_unfinished_output_is_not_reused(setup):
    model, recipe_file, runs, fake = setup
    text = recipe_file.read_text()
    plan = run_once(text, runs, fake)
    st = plan.by_name()["eval.fp8"]
    (plan.store.stage_dir("eval.fp8", st.key) / "stage.json").unlink()  # killed mid-write
    run_once(text, runs, fake)
    assert fake.calls == ["eval.fp8"]


def test_only_from_force_and_missing_inputs(setup):
    model, recipe_file, runs, fake = setup
    text = recipe_file.read_text()
    with pytest.raises(RecipeError, match="needs finetune, which is neither cached"):
        make_plan(parse_recipe(text), runs, only=["quantize"])
    with pytest.raises(RecipeError, match="--only 'bench': no such stage"):
        make_plan(parse_recipe(text), runs, only=["bench"])
    plan = run_once(text, runs, fake, only=["analyze", "finetune"])
    assert fake.calls == ["analyze", "finetune"]
    assert plan.by_name()["eval.base"].status == "not selected"
    run_once(text, runs, fake, start="quantize.fp8")
    assert fake.calls == ["quantize.fp8", "eval.fp8"]
    with pytest.raises(RecipeError, match="eval.rtn-int8 needs quantize.rtn-int8"):
        make_plan(parse_recipe(text), runs, only=["eval"])
    run_once(text, runs, fake)  # the ones never selected
    assert fake.calls == ["quantize.rtn-int8", "eval.base", "eval.finetuned", "eval.rtn-int8"]
    run_once(text, runs, fake, only=["eval"], force=True)
    assert fake.calls == ["eval.base", "eval.finetuned", "eval.rtn-int8", "eval.fp8"]


def test_a_gguf_model_is_converted_once_for_every_scheme(tmp_path, wikitext_dir):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    text = (f"name: g\nmodel: {gguf}\ndata: {wikitext_dir}\nstages:\n  quantize:\n"
            "    methods: [rtn-int8, fp8]\n  eval: {}\n")
    fake = FakeStages()
    run_once(text, tmp_path / "runs", fake)
    assert fake.calls == ["convert", "quantize.rtn-int8", "quantize.fp8", "eval.base",
                          "eval.rtn-int8", "eval.fp8"]
    # the base variant reads the converted safetensors too (one slow GGUF load, not one a stage)
    from llmaccel.pipeline.dag import build_graph
    r = parse_recipe(text + "  draft: {methods: [ngram, head]}\n")
    reads = {n.name: n.inputs["model"] for n in build_graph(r, str(gguf))}
    assert reads["eval.base"] == reads["draft.head"] == reads["spec.ngram"] == "convert"
    assert reads["convert"] == "model"


# -- end to end, real stages on a tiny model ---------------------------------------------------
def test_cli_runs_a_tiny_recipe_end_to_end_then_from_cache(tmp_path, wikitext_dir):
    from typer.testing import CliRunner

    from llmaccel.cli import app
    from server_harness import make_model_dir

    model = make_model_dir(tmp_path / "tiny")
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(f"""\
name: tiny
model: {model}
data: {wikitext_dir}
device: cpu
dtype: float32
stages:
  analyze: {{}}
  finetune: {{steps: 2, batch_size: 1, seq_len: 32, eval_every: 1, max_blocks: 8}}
  quantize: {{methods: [rtn-int8, fp8]}}
  eval: {{context: 32, limit: 2}}
  bench: {{workloads: [latency, serve], backends: [llmaccel, hf-eager], quick: true,
          repeats: 1, request_rates: [8]}}
  draft: {{methods: [ngram, head], steps: 2, batch_size: 1, seq_len: 32, max_blocks: 8,
          batches: [1], kinds: [prose], max_tokens: 8, repeats: 1,
          variants: [finetuned, fp8]}}
  report: {{}}
""")
    runs = tmp_path / "runs"
    runner = CliRunner()
    res = runner.invoke(app, ["run", str(recipe), "--runs-dir", str(runs)])
    assert res.exit_code == 0, res.output
    summary = json.loads((runs / "tiny" / "run.json").read_text())
    assert [s["status"] for s in summary["stages"]] == ["ran"] * 22
    for s in summary["stages"]:
        record = json.loads((runs / "tiny" / s["dir"] / "stage.json").read_text())
        assert record["key"] == s["key"]
        if s["kind"] == "eval":
            ppl = json.loads((runs / "tiny" / s["dir"] / "ppl.json").read_text())
            assert ppl["ppl"] > 1 and ppl["windows"] == 2 and ppl["context"] == 32
        if s["kind"] == "quantize":
            cfg = json.loads((runs / "tiny" / s["dir"] / "checkpoint" / "config.json")
                             .read_text())
            assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    # the report: one row per variant and engine, HF only on the unquantized ones
    report_dir = runs / "tiny" / summary["stages"][-1]["dir"]
    md = (report_dir / "report.md").read_text()
    section = md.split("## Method x engine")[1].split("\n## ")[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and "tok/s" not in ln]
    table = [ln.split(" | ")[:3] for ln in rows]
    assert table == [["| base", "fp32", "llmaccel"], ["| base", "fp32", "hf-eager"],
                     ["| finetuned", "fp32", "llmaccel"],
                     ["| rtn-int8", "rtn-int8", "llmaccel"], ["| fp8", "fp8", "llmaccel"]]
    assert "## Fine-tuning (LoRA)" in md and "| rtn-int8 | rtn |" in md
    # W5 on the fine-tuned model and on its fp8 checkpoint, the head trained once
    spec_rows = [ln.split(" | ")[:2] for ln in md.splitlines()
                 if ln.startswith(("| finetuned |", "| fp8 |")) and "| prose |" in ln]
    assert spec_rows == [["| finetuned", "ngram"], ["| fp8", "ngram"], ["| finetuned", "head"],
                         ["| fp8", "head"]]
    assert all(ln.endswith("| yes |") for ln in md.splitlines()
               if "| prose | 1 |" in ln)  # lossless
    w5 = json.loads((report_dir / "records" / "spec.head.fp8-W5.jsonl").read_text()
                    .splitlines()[0])
    assert w5["config"]["quantization"] == "fp8" and w5["config"]["target_variant"] == "fp8"
    # 4 W6, 4 W1, 4 W3 (our engine only), 4 W5
    records = [p for p in (report_dir / "records").glob("*.jsonl")
               if not p.name.endswith(".requests.jsonl")]
    assert len(records) == 16
    assert "### W3" in md
    # the W3 runs' per-request rows came along: the report draws their latency CDFs
    sidecars = sorted(p.name for p in (report_dir / "records").glob("*.requests.jsonl"))
    assert [n for n in sidecars if ".serve" in n], sidecars
    assert "latency_cdf.png" in md and "W3 per-request latency CDFs" in md
    # perplexity vs speed: the schemes are compared with the model they were made from
    assert "The unquantized point is the `finetuned` variant" in md
    res = runner.invoke(app, ["run", str(recipe), "--runs-dir", str(runs), "--dry-run"])
    assert res.exit_code == 0 and "run " not in res.output.replace("run.json", "")
    res = runner.invoke(app, ["run", str(recipe), "--runs-dir", str(runs)])
    summary = json.loads((runs / "tiny" / "run.json").read_text())
    assert res.exit_code == 0 and {s["status"] for s in summary["stages"]} == {"cached"}


def test_the_recipes_in_the_repository_parse():
    from llmaccel.pipeline.recipe import load_recipe

    files = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))
    assert files
    for f in files:
        assert load_recipe(f).name == f.stem


def test_spec_stage_passes_the_configured_crossover(monkeypatch, tmp_path):
    """The draft stage's disable_by_batch_size reaches the speculative config of W5."""
    from llmaccel.bench import command as bench_command
    from llmaccel.pipeline import stages
    from llmaccel.pipeline.dag import StageNode, build_graph

    seen: dict = {}

    def fake_run_workload(kind, model, out, workload, **kw):
        seen.update(kw)
        return tmp_path / "W5.jsonl"

    monkeypatch.setattr(bench_command, "run_workload", fake_run_workload)
    monkeypatch.setattr(stages, "_relabel", lambda *a, **k: None)
    monkeypatch.setattr(stages, "_max_positions", lambda m: 4096)
    r = parse_recipe("stages:\n  draft:\n    methods: [ngram]\n"
                     "    disable_by_batch_size: {ngram: 16}\n")
    node = next(n for n in build_graph(r, "m") if n.name == "spec.ngram")
    assert isinstance(node, StageNode)
    stages.run_spec(node, stages.StageInputs(source="m", models={"model": "m"}), tmp_path)
    spec = json.loads(seen["speculative_config"][0])
    assert spec == {"method": "ngram", "num_speculative_tokens": 4,
                    "disable_by_batch_size": 16}
    assert seen["max_model_len"] == 2048


def test_a_home_relative_model_path_is_expanded(monkeypatch, tmp_path):
    """`model: ~/...` (the study recipe's GGUF) reaches the converter as a real path."""
    from llmaccel.models import convert
    from llmaccel.pipeline.runner import resolve_model
    from llmaccel.quant.schemes import hf_source

    monkeypatch.setenv("HOME", str(tmp_path))
    seen = []
    monkeypatch.setattr(convert, "gguf_to_hf_dir", lambda src, out, dtype, **kw: seen.append(src))
    hf_source("~/m.gguf", tmp_path / "work")
    assert seen == [tmp_path / "m.gguf"]
    assert resolve_model(parse_recipe("model: ~/m.gguf\n")) == str(tmp_path / "m.gguf")
    assert resolve_model(parse_recipe("model: Qwen/Qwen2.5-Coder-1.5B\n")) == \
        "Qwen/Qwen2.5-Coder-1.5B"


def test_relabel_names_the_recipe_model_in_records_and_markdown(tmp_path):
    """A quantized variant's bench stage runs a directory called `checkpoint`: its records
    and its markdown headings must name the recipe's model and the variant instead."""
    from llmaccel.bench.results import Record, read_jsonl, write_jsonl
    from llmaccel.pipeline import stages

    ckpt = tmp_path / "quantize.fp8-abc" / "checkpoint"
    ckpt.mkdir(parents=True)
    path = tmp_path / "latency.jsonl"
    write_jsonl(path, [Record("W1", "checkpoint", "safetensors", "llmaccel", {"batch": 1},
                              "tok_s", 1.0, "cpu", "2", "abc", "llmaccel bench latency")])
    path.with_suffix(".md").write_text("# W1\n\n## W1 — checkpoint\n\n| backend |\n"
                                       "- checkpoint stays in prose\n")
    stages._relabel(path, "/models/qwen-1.5b.gguf", {"quantization": "fp8"}, str(ckpt), "fp8")
    (rec,) = read_jsonl(path)
    assert rec.model == "qwen-1.5b" and rec.config == {"batch": 1, "quantization": "fp8"}
    md = path.with_suffix(".md").read_text()
    assert "## W1 — qwen-1.5b (fp8)" in md and "— checkpoint" not in md
    assert "- checkpoint stays in prose" in md
