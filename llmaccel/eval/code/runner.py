"""Functional code accuracy: generate completions of the problems, run each program against
its tests in the sandbox, and report pass@k (HumanEval's metric).

Prompt modes:
- completion (default): the model continues the prompt (a signature and a docstring) as in
  HumanEval; generation stops at the first line that starts a new top-level statement
  (`STOP_SEQUENCES`), and the program is prompt + completion + tests.
- chat: the prompt is put in a chat message asking for the completed function; the code is
  the first fenced block of the reply (```python, ```py or ```), else the whole reply. Code
  that defines the entry point itself is used alone, after the prompt's imports; otherwise it
  is taken as the function's body and appended to the prompt.

pass@k is the unbiased estimator of Chen et al. (2021): with n samples per problem of which c
pass, pass@k = 1 - C(n - c, k) / C(n, k), averaged over problems. With greedy decoding and one
sample, pass@1 is the fraction of problems passed.

Variants evaluate the same model under other engine settings (a speculative config, a
quantization through hf_overrides, another checkpoint through "model"); the base variant
(the plain settings) always runs first. Speculative decoding must not change greedy output:
for variants with a speculative_config, greedy completions are compared with the base's.
"""

from __future__ import annotations

import gc
import json
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from llmaccel.errors import LLMAccelError
from llmaccel.eval.code.problems import Problem
from llmaccel.eval.code.sandbox import STATUSES, SandboxLimits, SandboxResult, run_programs

MODES = ("completion", "chat")
# A new top-level statement ends the function (HumanEval's stops, plus a closing fence).
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n```")
CHAT_INSTRUCTION = ("Complete the following Python function. Reply with the complete function "
                    "(its imports, signature and body) in one ```python code block.\n\n")
BASE = "base"
PASS_AT_K = (1, 5, 10, 100)  # reported where k <= samples per problem
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:\n[ \t]*```|\Z)", re.DOTALL)
_VARIANT_NAME = re.compile(r"^[A-Za-z0-9][\w.+-]*$")


# -- pass@k --------------------------------------------------------------------------------
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem: n samples, c of them correct."""
    if n < 1 or not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_pass_at_k(correct: Sequence[int], n: int, k: int) -> float:
    """pass@k averaged over problems, `correct[i]` samples of n passing for problem i."""
    if not correct:
        return 0.0
    return sum(pass_at_k(n, c, k) for c in correct) / len(correct)


# -- from a model's text to a program -------------------------------------------------------
def truncate_at_stops(text: str, stops: Sequence[str] = STOP_SEQUENCES) -> str:
    """text up to the earliest stop sequence (the engine stops there too; a completion from
    elsewhere may run on)."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]


def extract_code_block(text: str) -> str | None:
    """The first fenced code block (```python, ```py, ```python3 or a bare ```), preferring a
    Python one; an unterminated fence runs to the end. None without a fence."""
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]
    if not blocks:
        return None
    for lang, code in blocks:
        if lang in ("python", "py", "python3"):
            return code
    for lang, code in blocks:
        if lang == "":
            return code
    return blocks[0][1]


def defines(code: str, name: str) -> bool:
    """Whether code defines `name` at top level (`def name(` or `async def name(`)."""
    return re.search(rf"^(?:async\s+)?def\s+{re.escape(name)}\s*\(", code, re.MULTILINE) \
        is not None


def solution_source(problem: Problem, text: str, mode: str) -> str:
    """The source that defines the entry point, from the model's text (the tests follow)."""
    if mode == "completion":
        return problem.prompt + truncate_at_stops(text)
    if mode != "chat":
        raise LLMAccelError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    code = extract_code_block(text)
    code = text if code is None else code
    if defines(code, problem.entry_point):
        return problem.imports + "\n" + code
    lines = code.splitlines()
    first = next((line for line in lines if line.strip()), "")
    if first and not first[0].isspace():  # a body written without its indentation
        code = "\n".join(("    " + line) if line.strip() else line for line in lines)
    return problem.prompt + code


def chat_messages(problem: Problem) -> list[dict[str, str]]:
    return [{"role": "user",
             "content": f"{CHAT_INSTRUCTION}```python\n{problem.prompt}```"}]


# -- generation ---------------------------------------------------------------------------
@dataclass(frozen=True)
class GenerationSettings:
    mode: str = "completion"
    max_tokens: int = 384
    samples: int = 1           # completions per problem
    temperature: float = 0.0   # 0: greedy
    seed: int = 0              # sampling: problem i draws with seed + i

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise LLMAccelError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.max_tokens < 1 or self.samples < 1:
            raise LLMAccelError("max_tokens and samples must be >= 1")
        if self.temperature < 0:
            raise LLMAccelError(f"temperature must be >= 0, got {self.temperature}")
        if self.samples > 1 and self.temperature == 0:
            raise LLMAccelError(f"{self.samples} samples per problem at temperature 0 are "
                                "all the same greedy completion: set a temperature (e.g. "
                                "0.8) to estimate pass@k")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Generated:
    """A problem's completions (`samples` texts), or why the engine rejected its request."""
    texts: list[str]
    error: str | None = None


# (problems, settings) -> one Generated (or list of texts) per problem
Generator = Callable[[Sequence[Problem], GenerationSettings], Sequence[Any]]


def engine_generator(llm: Any, progress: bool = True) -> Generator:
    """Completions through an `LLM` (ours, or anything with vLLM's generate/chat)."""
    from llmaccel.engine.sampling_params import SamplingParams

    def generate(problems: Sequence[Problem], s: GenerationSettings) -> list[Generated]:
        stop = list(STOP_SEQUENCES) if s.mode == "completion" else None
        params = [SamplingParams(n=s.samples, temperature=s.temperature, max_tokens=s.max_tokens,
                                 stop=stop, seed=None if s.greedy else s.seed + i)
                  for i in range(len(problems))]
        if s.mode == "chat":
            outs = llm.chat([chat_messages(p) for p in problems], params, use_tqdm=progress)
        else:
            outs = llm.generate([p.prompt for p in problems], params, use_tqdm=progress)
        return [Generated([c.text for c in o.outputs], getattr(o, "error", None))
                for o in outs]
    return generate


def _normalize(generated: Sequence[Any], problems: Sequence[Problem],
               samples: int) -> list[Generated]:
    if len(generated) != len(problems):
        raise LLMAccelError(f"{len(generated)} generations for {len(problems)} problems")
    out = []
    for g in generated:
        g = g if isinstance(g, Generated) else Generated(list(g))
        texts = (list(g.texts) + [""] * samples)[:samples]
        out.append(Generated(texts, g.error))
    return out


# -- scoring ------------------------------------------------------------------------------
@dataclass
class SampleOutcome:
    """One completion of one problem, tested."""
    variant: str
    task_id: str
    entry_point: str
    sample: int
    passed: bool
    status: str          # sandbox status, or "error" when the engine rejected the request
    seconds: float
    completion: str      # the model's text
    code: str            # what was run before the tests (prompt + completion, or extracted)
    stderr: str


@dataclass
class VariantResult:
    name: str
    kwargs: dict[str, Any]
    samples: int
    outcomes: list[SampleOutcome]
    generate_s: float = 0.0
    test_s: float = 0.0
    differing_from_base: int | None = None    # speculative variants, greedy decoding
    model: str = ""
    load_format: str = "unknown"

    @property
    def n_problems(self) -> int:
        return len({o.task_id for o in self.outcomes})

    def correct_per_problem(self) -> list[int]:
        counts: dict[str, int] = {}
        for o in self.outcomes:
            counts[o.task_id] = counts.get(o.task_id, 0) + int(o.passed)
        return list(counts.values())

    def pass_at(self, k: int) -> float:
        return mean_pass_at_k(self.correct_per_problem(), self.samples, k)

    @property
    def ks(self) -> list[int]:
        return [k for k in PASS_AT_K if k <= self.samples]

    @property
    def passed(self) -> int:
        return sum(o.passed for o in self.outcomes)

    def status_counts(self) -> dict[str, int]:
        counts = Counter(o.status for o in self.outcomes)
        return {s: counts.get(s, 0) for s in STATUSES}

    def completions(self) -> dict[tuple[str, int], str]:
        return {(o.task_id, o.sample): o.completion for o in self.outcomes}


def score(problems: Sequence[Problem], generated: Sequence[Any], settings: GenerationSettings,
          limits: SandboxLimits | None = None, workers: int | None = None,
          variant: str = BASE,
          on_result: Callable[[int, SandboxResult], None] | None = None
          ) -> list[SampleOutcome]:
    """Test every completion: one sandboxed process each, `workers` at a time."""
    gens = _normalize(generated, problems, settings.samples)
    jobs: list[tuple[Problem, int, str, str]] = []
    outcomes: list[SampleOutcome | None] = []
    for p, g in zip(problems, gens):
        for j, text in enumerate(g.texts):
            code = solution_source(p, text, settings.mode)
            if g.error:  # rejected by the engine (e.g. longer than the context): not run
                outcomes.append(SampleOutcome(variant, p.task_id, p.entry_point, j, False,
                                              "error", 0.0, text, code, g.error))
            else:
                outcomes.append(None)
                jobs.append((p, j, text, code))
    results = run_programs([p.assemble(code) for p, _, _, code in jobs], limits, workers,
                           on_result)
    it = iter(zip(jobs, results))
    for i, o in enumerate(outcomes):
        if o is None:
            (p, j, text, code), r = next(it)
            outcomes[i] = SampleOutcome(variant, p.task_id, p.entry_point, j, r.passed,
                                        r.status, round(r.seconds, 3), text, code, r.stderr)
    return outcomes  # type: ignore[return-value]


def evaluate(problems: Sequence[Problem], generator: Generator, settings: GenerationSettings,
             limits: SandboxLimits | None = None, workers: int | None = None,
             variant: str = BASE, kwargs: dict[str, Any] | None = None,
             on_result: Callable[[int, SandboxResult], None] | None = None) -> VariantResult:
    """Generate with `generator`, then test: one variant's result."""
    start = time.perf_counter()
    generated = generator(problems, settings)
    generate_s = time.perf_counter() - start
    start = time.perf_counter()
    outcomes = score(problems, generated, settings, limits, workers, variant, on_result)
    return VariantResult(variant, dict(kwargs or {}), settings.samples, outcomes,
                         generate_s, time.perf_counter() - start)


# -- variants -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra LLM(...) keyword arguments

    @property
    def speculative(self) -> bool:
        return self.kwargs.get("speculative_config") is not None


def _engine_fields() -> list[str]:
    from llmaccel.engine.config import EngineConfig

    return [f.name for f in fields(EngineConfig)]


def parse_variant(text: str) -> Variant:
    """'NAME=JSON' (JSON: an object of extra LLM keyword arguments) -> Variant."""
    name, sep, payload = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise LLMAccelError(f"--variant takes NAME=JSON, e.g. 'ngram={{\"speculative_config\": "
                            f"{{\"method\": \"ngram\"}}}}', got {text!r}")
    if not _VARIANT_NAME.match(name):
        raise LLMAccelError(f"variant name {name!r}: use letters, digits, '_', '-', '.', '+'")
    if name == BASE:
        raise LLMAccelError(f"variant name '{BASE}' is taken by the plain settings (always run "
                            "first)")
    try:
        kwargs = json.loads(payload)
    except json.JSONDecodeError as e:
        raise LLMAccelError(f"variant '{name}': not valid JSON ({e.msg} at column "
                            f"{e.colno}): {payload!r}") from None
    if not isinstance(kwargs, dict):
        raise LLMAccelError(f"variant '{name}': the JSON must be an object of LLM keyword "
                            f"arguments, got {type(kwargs).__name__}")
    allowed = _engine_fields()
    unknown = [k for k in kwargs if k not in allowed]
    if unknown:
        raise LLMAccelError(f"variant '{name}': unknown engine setting(s) "
                            f"{', '.join(map(repr, unknown))} (known: {', '.join(allowed)})")
    spec = kwargs.get("speculative_config")
    if spec is not None and not isinstance(spec, dict):
        raise LLMAccelError(f"variant '{name}': speculative_config must be an object, e.g. "
                            "{\"method\": \"ngram\", \"num_speculative_tokens\": 4}")
    return Variant(name, kwargs)


def parse_variants(texts: Sequence[str]) -> list[Variant]:
    """The base variant, then each --variant in order (names unique)."""
    variants = [Variant(BASE)]
    for text in texts:
        v = parse_variant(text)
        if any(v.name == other.name for other in variants):
            raise LLMAccelError(f"variant name '{v.name}' is given twice")
        variants.append(v)
    return variants


def count_differing(result: VariantResult, base: VariantResult) -> int:
    """Completions (problem, sample) whose text differs from the base variant's."""
    theirs = base.completions()
    return sum(text != theirs.get(key) for key, text in result.completions().items())


# -- a whole run --------------------------------------------------------------------------
@dataclass(frozen=True)
class CodeEvalSettings:
    model: str | None
    problems: tuple[Problem, ...]
    generation: GenerationSettings = GenerationSettings()
    limits: SandboxLimits = SandboxLimits()
    variants: tuple[Variant, ...] = (Variant(BASE),)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # every variant's LLM(...)
    workers: int | None = None
    out_dir: Path = Path("results")
    name: str = "code"
    command: str = "llmaccel eval code"


@dataclass
class CodeEvalReport:
    model: str
    variants: list[VariantResult]
    records_path: Path
    problems_path: Path
    sandbox: str
    records: list[Any] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "sandbox": self.sandbox,
                "records": str(self.records_path), "problems": str(self.problems_path),
                "variants": [{"variant": v.name, "kwargs": v.kwargs,
                              "n_problems": v.n_problems, "samples": v.samples,
                              **{f"pass_at_{k}": v.pass_at(k) for k in v.ks},
                              "passed": v.passed, "statuses": v.status_counts(),
                              "completions_differing_from_base": v.differing_from_base,
                              "generate_s": round(v.generate_s, 2),
                              "test_s": round(v.test_s, 2)} for v in self.variants]}


def default_name(model: str | None) -> str:
    """A file-name stem from the model ("smollm2-135m-instruct" for the default one)."""
    if model is None:
        return "smollm2-135m-instruct"
    stem = Path(model.rstrip("/")).name or model
    stem = re.sub(r"\.gguf$", "", stem, flags=re.IGNORECASE)
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", stem).strip("-.") or "model"


def free_memory() -> None:
    gc.collect()
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _describe_model(llm: Any, fallback: str) -> tuple[str, str, str]:
    """(model name, load format, device name) of a loaded LLM (fallbacks for stand-ins)."""
    engine = getattr(llm, "engine", None)
    mc = getattr(engine, "model_config", None)
    name = getattr(mc, "name", None) or fallback
    load_format = getattr(mc, "load_format", None) or "unknown"
    device = getattr(engine, "device", None)
    if device is None:
        return name, load_format, "unknown"
    from llmaccel.device import device_name

    return name, load_format, device_name(device)


def _quantization(kwargs: dict[str, Any]) -> Any:
    if kwargs.get("quantization") is not None:
        return kwargs["quantization"]
    overrides = kwargs.get("hf_overrides") or {}
    return overrides.get("quantization_config") if isinstance(overrides, dict) else None


def _record_config(v: VariantResult, s: CodeEvalSettings) -> dict[str, Any]:
    g = s.generation
    config: dict[str, Any] = {"variant": v.name, "n_problems": v.n_problems,
                              "max_tokens": g.max_tokens, "mode": g.mode,
                              "samples": g.samples, "temperature": g.temperature,
                              "passed": v.passed, "statuses": v.status_counts()}
    quant = _quantization(v.kwargs)
    if quant is not None:
        config["quantization"] = quant
    if v.kwargs.get("speculative_config") is not None:
        config["speculative_config"] = v.kwargs["speculative_config"]
    if v.differing_from_base is not None:
        config["completions_differing_from_base"] = v.differing_from_base
    if "model" in v.kwargs:
        config["model"] = v.kwargs["model"]
    return config


def run_code_eval(s: CodeEvalSettings, llm_factory: Callable[..., Any] | None = None,
                  progress: bool = True, console: Any = None) -> CodeEvalReport:
    """Every variant in turn: load (LLM(model, **engine_kwargs, **variant kwargs)), generate,
    free the model, test in the sandbox; then write the per-problem outcomes and the records.
    `llm_factory` stands in for `llmaccel.LLM` (tests)."""
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
    from rich.progress import TimeElapsedColumn

    from llmaccel.bench.results import RunMeta, current_commit, make_record, write_jsonl
    from llmaccel.eval.code.sandbox import sandbox_identity

    if llm_factory is None:
        from llmaccel.engine.llm import LLM as llm_factory
    problems = list(s.problems)
    ident = sandbox_identity(s.limits.python, s.limits.drop_root, s.limits.network_namespace)
    results: list[VariantResult] = []
    device = "unknown"
    model_name = default_name(s.model) if s.model is None else s.model
    for v in s.variants:
        kwargs = {**s.engine_kwargs, **v.kwargs}
        model = kwargs.pop("model", s.model)
        try:
            llm = llm_factory(model, **kwargs)
        except TypeError as e:  # settings of the wrong type or shape (user input)
            raise LLMAccelError(f"variant '{v.name}': bad engine settings {v.kwargs}: "
                                f"{e}") from e
        try:
            name, load_format, dev = _describe_model(llm, str(model))
            if v.name == BASE:
                model_name, device = name, dev
            start = time.perf_counter()
            generated = engine_generator(llm, progress)(problems, s.generation)
            generate_s = time.perf_counter() - start
        finally:
            del llm
            free_memory()
        columns = (TextColumn("[progress.description]{task.description}"), BarColumn(),
                   MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, transient=True, disable=not progress, console=console) as bar:
            task = bar.add_task(f"testing {v.name}", total=len(problems) * s.generation.samples)
            start = time.perf_counter()
            outcomes = score(problems, generated, s.generation, s.limits, s.workers, v.name,
                             lambda i, r: bar.advance(task))
        result = VariantResult(v.name, v.kwargs, s.generation.samples, outcomes, generate_s,
                               time.perf_counter() - start, model=name,
                               load_format=load_format)
        if v.speculative and s.generation.greedy and results:
            result.differing_from_base = count_differing(result, results[0])
        results.append(result)

    s.out_dir.mkdir(parents=True, exist_ok=True)
    problems_path = s.out_dir / f"{s.name}-code.problems.jsonl"
    with open(problems_path, "w") as f:
        for v in results:
            f.writelines(json.dumps(asdict(o)) + "\n" for o in v.outcomes)
    meta = RunMeta(device, torch.__version__, current_commit(), s.command)
    records = []
    for v in results:
        config = _record_config(v, s)
        for k in v.ks:
            records.append(make_record(meta, "code", v.model or model_name, "llmaccel", config,
                                       f"pass_at_{k}", v.pass_at(k), load_format=v.load_format))
    records_path = s.out_dir / f"{s.name}-code.jsonl"
    write_jsonl(records_path, records)
    return CodeEvalReport(model_name, results, records_path, problems_path, ident.describe(),
                          records)
