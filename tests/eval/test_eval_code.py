"""`llmaccel eval code` (llmaccel/eval/code): the problem set validates itself (every canonical
solution passes its tests and docstring examples in the sandbox; a candidate returning None
fails every problem's tests), the sandbox's limits (timeout, memory, network, process and file
guards, early exits), extraction of programs from completions, the pass@k estimator by hand,
the runner with stand-in generators and engines, and the command on a tiny random model."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import pytest
import typer
from tiny_models import make_tiny_model, tiny_configs
from typer.testing import CliRunner

from llmaccel.bench.results import read_jsonl
from llmaccel.errors import LLMAccelError
from llmaccel.cli.eval_code import eval_code, render
from llmaccel.eval.code.problems import Problem, load_problems, parse_problems
from llmaccel.eval.code.runner import (BASE, CodeEvalSettings, Generated, GenerationSettings,
                                       Variant, default_name, evaluate, extract_code_block,
                                       mean_pass_at_k, parse_variant, parse_variants,
                                       pass_at_k, run_code_eval, solution_source,
                                       truncate_at_stops)
from llmaccel.eval.code.sandbox import (SandboxLimits, run_program, run_programs,
                                        sandbox_identity)

PROBLEMS = load_problems()
LIMITS = SandboxLimits(timeout_s=20, memory_mb=512)
# Appended to a canonical program: the docstring's examples must hold too.
DOCTESTS = """
import doctest as _doctest
_runner = _doctest.DocTestRunner(verbose=False)
for _test in _doctest.DocTestFinder().find({entry}, "{entry}", globs=globals()):
    _runner.run(_test)
assert _runner.tries > 0 and _runner.failures == 0, "docstring examples"
"""
REJECTS_NONE = """
try:
    check(lambda *args, **kwargs: None)
except Exception:
    pass
else:
    raise AssertionError("check() accepts a candidate that returns None")
"""


# -- the problem set ----------------------------------------------------------------------
def test_problem_set_layout():
    assert len(PROBLEMS) >= 45
    assert [p.task_id for p in PROBLEMS] == [f"llmaccel/{i}" for i in range(len(PROBLEMS))]
    assert len({p.entry_point for p in PROBLEMS}) == len(PROBLEMS)
    for p in PROBLEMS:
        assert p.prompt.rstrip().endswith('"""') and ">>> " in p.prompt, p.task_id
        assert p.test.count("assert") >= 4, p.task_id
        assert p.canonical_solution.startswith("    "), p.task_id
        for line in p.imports.splitlines():  # standard library only
            assert line.split()[1].split(".")[0] in sys.stdlib_module_names, line
    assert load_problems(limit=3) == PROBLEMS[:3]
    first = json.loads((Path(__file__).parents[2] / "llmaccel/eval/code/problems.jsonl")
                       .read_text().splitlines()[0])
    assert list(first) == ["task_id", "prompt", "canonical_solution", "test", "entry_point"]


def test_problem_file_errors(tmp_path):
    good = json.dumps(PROBLEMS[0].to_dict())
    assert parse_problems([good, ""], "x") == [PROBLEMS[0]]
    with pytest.raises(LLMAccelError, match="x:1: not valid JSON"):
        parse_problems(["{"], "x")
    with pytest.raises(LLMAccelError, match="missing field"):
        parse_problems([json.dumps({"task_id": "a"})], "x")
    with pytest.raises(LLMAccelError, match="duplicate task_id"):
        parse_problems([good, good], "x")
    bad = dict(PROBLEMS[0].to_dict(), entry_point="other")
    with pytest.raises(LLMAccelError, match="does not define other"):
        parse_problems([json.dumps(bad)], "x")
    with pytest.raises(LLMAccelError, match="does not exist"):
        load_problems(tmp_path / "none.jsonl")
    path = tmp_path / "mine.jsonl"
    path.write_text(good + "\n")
    assert load_problems(path) == [PROBLEMS[0]]


def test_canonical_solutions_pass_and_none_fails_every_problem():
    """All problems at once, in parallel: the canonical solution passes the tests and the
    docstring's examples; a body returning None fails (no problem's tests are vacuous); and
    check() itself rejects a candidate returning None, checked in the same process."""
    canonical = [p.program(p.canonical_solution) + DOCTESTS.format(entry=p.entry_point)
                 + REJECTS_NONE for p in PROBLEMS]
    wrong = [p.program("    return None\n") for p in PROBLEMS[:10]]
    results = run_programs(canonical + wrong, LIMITS)
    n = len(PROBLEMS)
    broken = [(p.task_id, r.status, r.stderr[-300:]) for p, r in zip(PROBLEMS, results[:n])
              if not r.passed]
    assert not broken, broken
    assert all(r.status in ("failed", "error") for r in results[n:])


# -- the sandbox --------------------------------------------------------------------------
def test_timeouts_kill_quickly():
    start = time.perf_counter()
    results = run_programs(["while True:\n    pass\n", "import time\ntime.sleep(60)\n"],
                           SandboxLimits(timeout_s=1.0), workers=2)
    assert [r.status for r in results] == ["timeout", "timeout"]
    assert not any(r.passed for r in results)
    assert time.perf_counter() - start < 8


def test_memory_bomb_is_stopped():
    bomb = "chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))\n"
    huge = "x = [0] * (10 ** 10)\n"
    for r in run_programs([bomb, huge], SandboxLimits(timeout_s=20, memory_mb=256)):
        assert not r.passed and r.status in ("memory", "error"), r
        assert r.status == "memory", r.stderr


def test_network_is_off():
    program = """
import socket, urllib.request
for attempt in (lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM),
                lambda: socket.create_connection(("127.0.0.1", 9)),
                lambda: socket.getaddrinfo("example.com", 80),
                lambda: urllib.request.urlopen("http://127.0.0.1:9/", timeout=2)):
    try:
        attempt()
    except OSError:
        continue
    raise AssertionError("network access worked")
"""
    r = run_program(program, LIMITS)
    assert r.passed, r.stderr


def test_network_namespace_stops_bypasses():
    """Python-level replacements can be undone; the network namespace (where unshare -rn
    works) still leaves no route, even to a server listening on our loopback."""
    ident = sandbox_identity()
    if not ident.network_namespace:
        pytest.skip("unshare -rn does not work here")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        program = f"""
import sys
del sys.modules["_socket"]
import _socket  # a fresh copy of the C module: the harness's replacements are gone
s = _socket.socket()
s.settimeout(3)
try:
    s.connect(("127.0.0.1", {port}))
except OSError:
    pass
else:
    raise AssertionError("connected to the host's loopback")
"""
        r = run_program(program, LIMITS)
    assert r.passed, r.stderr


def test_guards_and_early_exits(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    target = tmp_path / "written.txt"
    programs = {
        "remove": f"import os\nos.remove({str(victim)!r})\n",
        "rmtree": f"import shutil\nshutil.rmtree({str(tmp_path)!r})\n",
        "write": f"open({str(target)!r}, 'w').write('x')\n",
        "os_exit": "import os\nos._exit(0)\nassert False\n",
        "sys_exit": "import sys\nsys.exit(0)\n",
        "subprocess": "import subprocess\nsubprocess.run(['true'])\n",
        "fork": "import os\nos.fork()\n",
        "syntax": "def broken(:\n",
        "assert": "assert 1 == 2\n",
        "inside": "open('here.txt', 'w').write('ok')\nassert open('here.txt').read() == 'ok'\n",
    }
    results = dict(zip(programs, run_programs(list(programs.values()), LIMITS)))
    assert victim.read_text() == "keep" and not target.exists()
    for name in ("remove", "rmtree", "write", "sys_exit", "subprocess", "fork", "syntax"):
        assert results[name].status == "error", (name, results[name])
    assert "PermissionError" in results["remove"].stderr
    assert results["os_exit"].status == "error"
    assert "exited before its tests finished" in results["os_exit"].stderr
    assert results["assert"].status == "failed"
    assert results["inside"].passed


# -- from completions to programs ---------------------------------------------------------
SQUARE = Problem("t/0", 'import math\n\n\ndef square(x: int) -> int:\n    """x squared."""\n',
                 "    return x * x\n", "\n\ndef check(candidate):\n    assert candidate(3) == 9\n",
                 "square")


def test_stop_sequences():
    text = "    return x * x\n\n\ndef other():\n    pass\n"
    assert truncate_at_stops(text) == "    return x * x\n\n"
    assert truncate_at_stops("    return 1\nprint(square(2))") == "    return 1"
    assert truncate_at_stops("    return 1\n# tests\nassert 1") == "    return 1"
    assert truncate_at_stops("    y = 1  # note\n    return y\n") == \
        "    y = 1  # note\n    return y\n"
    assert truncate_at_stops("    return 1\nif __name__ == '__main__':\n") == "    return 1"
    assert solution_source(SQUARE, text, "completion") == SQUARE.prompt + "    return x * x\n\n"


def test_fenced_blocks():
    assert extract_code_block("Sure:\n```python\ndef f():\n    return 1\n```\nDone.") == \
        "def f():\n    return 1"
    assert extract_code_block("```py\nx = 1\n```") == "x = 1"
    assert extract_code_block("```\nx = 2\n```") == "x = 2"
    assert extract_code_block("```text\nprose\n```\n```python\nx = 3\n```") == "x = 3"
    assert extract_code_block("```python\nx = 4\n") == "x = 4\n"  # unterminated: to the end
    assert extract_code_block("no fence here") is None


def test_chat_solutions():
    redefined = "Here:\n```python\ndef square(x):\n    return math.prod([x, x])\n```\nBye"
    source = solution_source(SQUARE, redefined, "chat")
    assert source == "import math\n\ndef square(x):\n    return math.prod([x, x])"
    assert "x squared" not in source  # used alone, after the prompt's imports
    body = "```python\n    return x * x\n```"
    assert solution_source(SQUARE, body, "chat") == SQUARE.prompt + "    return x * x"
    unindented = "return x * x"  # no fence, no indentation: the raw text as the body
    assert solution_source(SQUARE, unindented, "chat") == SQUARE.prompt + "    return x * x"
    for text in (redefined, body, unindented):
        assert run_program(SQUARE.assemble(solution_source(SQUARE, text, "chat")),
                           LIMITS).passed


# -- pass@k -------------------------------------------------------------------------------
def test_pass_at_k_by_hand():
    assert pass_at_k(5, 0, 1) == 0.0
    assert pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)           # C(3,2) / C(5,2)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)        # C(7,5) / C(10,5)
    assert pass_at_k(4, 1, 4) == 1.0                                 # n - c < k
    assert pass_at_k(200, 1, 100) == pytest.approx(0.5)              # C(199,100)/C(200,100)
    assert mean_pass_at_k([0, 5], 5, 1) == pytest.approx(0.5)
    assert mean_pass_at_k([1, 2], 4, 2) == pytest.approx(((1 - 3 / 6) + (1 - 1 / 6)) / 2)
    for bad in ((5, 6, 1), (5, 1, 6), (5, 1, 0), (0, 0, 1)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


# -- the runner ---------------------------------------------------------------------------
SUBSET = PROBLEMS[:6]


def test_runner_with_fake_generators():
    greedy = GenerationSettings(max_tokens=64)
    canonical = evaluate(SUBSET, lambda ps, s: [[p.canonical_solution] for p in ps], greedy,
                         LIMITS)
    assert canonical.pass_at(1) == 1.0 and canonical.passed == len(SUBSET)
    wrong = evaluate(SUBSET, lambda ps, s: [["    pass\n"] for p in ps], greedy, LIMITS)
    assert wrong.pass_at(1) == 0.0 and wrong.passed == 0
    assert wrong.status_counts()["passed"] == 0

    two = GenerationSettings(samples=2, temperature=0.8)
    mixed = evaluate(SUBSET, lambda ps, s: [[p.canonical_solution, "    pass\n"] for p in ps],
                     two, LIMITS)
    assert mixed.pass_at(1) == pytest.approx(0.5) and mixed.pass_at(2) == 1.0
    assert mixed.ks == [1] and len(mixed.outcomes) == 2 * len(SUBSET)

    chat = GenerationSettings(mode="chat")
    replies = evaluate(SUBSET, lambda ps, s: [
        [f"Sure!\n```python\n{p.prompt}{p.canonical_solution}```\nIt works."] for p in ps],
        chat, LIMITS)
    assert replies.pass_at(1) == 1.0
    rejected = evaluate(SUBSET[:1], lambda ps, s: [Generated([], "prompt too long")], greedy)
    assert rejected.outcomes[0].status == "error" and rejected.outcomes[0].stderr


def test_generation_settings_and_variants():
    with pytest.raises(LLMAccelError, match="temperature"):
        GenerationSettings(samples=4)
    with pytest.raises(LLMAccelError, match="mode"):
        GenerationSettings(mode="fill")
    v = parse_variant('ngram={"speculative_config": {"method": "ngram"}}')
    assert v == Variant("ngram", {"speculative_config": {"method": "ngram"}}) and v.speculative
    assert not parse_variant('bf16={"dtype": "bfloat16"}').speculative
    names = [x.name for x in parse_variants(['a={}', 'b={"max_model_len": 512}'])]
    assert names == [BASE, "a", "b"]
    for text, match in [("ngram", "NAME=JSON"), ("x={bad", "not valid JSON"),
                        ("x=[1]", "object"), ('x={"speculative": 1}', "unknown engine"),
                        ("base={}", "taken"), ("a b={}", "variant name"),
                        ('x={"speculative_config": "ngram"}', "must be an object")]:
        with pytest.raises(LLMAccelError, match=match):
            parse_variant(text)
    with pytest.raises(LLMAccelError, match="twice"):
        parse_variants(["a={}", "a={}"])
    assert default_name(None) == "smollm2-135m-instruct"
    assert default_name("HuggingFaceTB/SmolLM2-360M") == "SmolLM2-360M"
    assert default_name("/models/q4 model.gguf") == "q4-model"


class _Out:
    def __init__(self, texts, error=None):
        self.outputs = [type("C", (), {"text": t})() for t in texts]
        self.error = error


class FakeLLM:
    """Stands in for LLM: canonical completions; a speculative one changes one of them."""
    made: list = []

    def __init__(self, model, **kwargs):
        self.kwargs = kwargs
        FakeLLM.made.append((model, kwargs))

    def generate(self, prompts, params, use_tqdm=True):
        by_prompt = {p.prompt: p for p in PROBLEMS}
        texts = [by_prompt[prompt].canonical_solution for prompt in prompts]
        if self.kwargs.get("speculative_config"):
            texts[0] = "    return None\n"
        assert all(p.stop and "\ndef " in p.stop and p.temperature == 0 for p in params)
        return [_Out([t]) for t in texts]


def test_run_with_variants_writes_records(tmp_path):
    FakeLLM.made = []
    settings = CodeEvalSettings(
        model="fake-model", problems=tuple(PROBLEMS[:4]), generation=GenerationSettings(),
        limits=LIMITS, engine_kwargs={"dtype": "float32"},
        variants=tuple(parse_variants(['ngram={"speculative_config": {"method": "ngram"}}',
                                       'other={"model": "other-dir", "dtype": "bfloat16"}'])),
        out_dir=tmp_path / "out", name="fake")
    report = run_code_eval(settings, llm_factory=FakeLLM, progress=False)
    assert FakeLLM.made == [("fake-model", {"dtype": "float32"}),
                            ("fake-model", {"dtype": "float32",
                                            "speculative_config": {"method": "ngram"}}),
                            ("other-dir", {"dtype": "bfloat16"})]
    base, ngram, other = report.variants
    assert base.pass_at(1) == 1.0 and ngram.pass_at(1) == 0.75 and other.pass_at(1) == 1.0
    assert ngram.differing_from_base == 1 and base.differing_from_base is None
    assert other.differing_from_base is None  # not speculative

    records = read_jsonl(tmp_path / "out" / "fake-code.jsonl")
    assert [(r.workload, r.metric, r.backend) for r in records] == [
        ("code", "pass_at_1", "llmaccel")] * 3
    assert [r.value for r in records] == [1.0, 0.75, 1.0]
    assert records[0].config["variant"] == BASE and records[0].config["n_problems"] == 4
    assert records[0].config["mode"] == "completion" and records[0].config["max_tokens"] == 384
    assert records[1].config["speculative_config"] == {"method": "ngram"}
    assert records[1].config["completions_differing_from_base"] == 1
    assert records[2].config["model"] == "other-dir"
    rows = [json.loads(line) for line in
            (tmp_path / "out" / "fake-code.problems.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and rows[4]["variant"] == "ngram" and not rows[4]["passed"]
    assert {"task_id", "sample", "status", "completion", "code", "stderr"} <= set(rows[0])

    from rich.console import Console
    console = Console(record=True, width=200)
    render(report, console)
    text = console.export_text()
    assert "ngram" in text and "75.0%" in text and "differ from base" in text


# -- the command on a tiny random model ---------------------------------------------------
def _byte_tokenizer(directory: Path) -> int:
    """A byte-level tokenizer without merges (every text encodes), with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<s>": 0, "</s>": 1, **{ch: i + 2 for i, ch in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    hf.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    hf.save_pretrained(directory)
    return len(vocab)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("code-tiny")
    config = tiny_configs()["llama"]
    config.vocab_size = _byte_tokenizer(d)
    config.bos_token_id, config.eos_token_id = 0, 1
    config.max_position_embeddings = 1024
    make_tiny_model(config, d)
    return d


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("code")(eval_code)

    @app.callback()
    def _root() -> None:  # a group, so the command is invoked as `code`
        pass
    return app


def test_command_on_tiny_model(tiny_model, tmp_path):
    out = tmp_path / "results"
    args = ["code", str(tiny_model), "--limit", "3", "--max-tokens", "8", "--device", "cpu",
            "--dtype", "float32", "--out", str(out), "--name", "tiny", "--timeout", "5",
            "--variant", 'ngram={"speculative_config": {"method": "ngram", '
            '"num_speculative_tokens": 2}}', "--json"]
    result = CliRunner().invoke(_app(), args)
    assert result.exit_code == 0, (result.output, result.exception)
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert [v["variant"] for v in summary["variants"]] == [BASE, "ngram"]
    assert all(v["n_problems"] == 3 and 0 <= v["pass_at_1"] <= 1 for v in summary["variants"])
    assert isinstance(summary["variants"][1]["completions_differing_from_base"], int)
    records = read_jsonl(out / "tiny-code.jsonl")
    assert len(records) == 2 and all(r.metric == "pass_at_1" for r in records)
    assert records[0].load_format == "safetensors" and records[0].torch
    assert records[1].config["speculative_config"]["method"] == "ngram"
    rows = [json.loads(line) for line in (out / "tiny-code.problems.jsonl").read_text()
            .splitlines()]
    assert len(rows) == 6 and {r["task_id"] for r in rows} == {p.task_id for p in PROBLEMS[:3]}

    chat = CliRunner().invoke(_app(), ["code", str(tiny_model), "--limit", "2", "--chat",
                                       "--max-tokens", "8", "--device", "cpu", "--out",
                                       str(out), "--name", "tiny-chat"])
    assert chat.exit_code == 0, (chat.output, chat.exception)
    assert "base" in chat.stdout and (out / "tiny-chat-code.jsonl").is_file()
    assert read_jsonl(out / "tiny-chat-code.jsonl")[0].config["mode"] == "chat"


def test_command_user_errors(tmp_path):
    runner = CliRunner()
    bad_json = runner.invoke(_app(), ["code", "--variant", "x={nope", "--out", str(tmp_path)])
    assert isinstance(bad_json.exception, LLMAccelError)
    assert "not valid JSON" in str(bad_json.exception)
    unknown = runner.invoke(_app(), ["code", "no-such-model", "--limit", "1", "--out",
                                     str(tmp_path)])
    assert isinstance(unknown.exception, LLMAccelError)
    assert "no-such-model" in str(unknown.exception)
