"""The problem set: HumanEval's field layout, our own problems (problems.jsonl, package data).

One JSON object a line with `task_id`, `prompt` (imports, a signature, a docstring with
examples), `canonical_solution` (the body completing the prompt), `test` (a `def
check(candidate):` of asserts) and `entry_point` (the function's name). The program that is
run is `prompt + completion + test + check(entry_point)` (see `Problem.program`), exactly as
for HumanEval, so a user's own file in that layout (HumanEval's included) loads here too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from llmaccel.errors import LLMAccelError

FIELDS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")
BUILTIN = "problems.jsonl"
_IDENTIFIER = re.compile(r"^[A-Za-z_]\w*$")


@dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str
    canonical_solution: str
    test: str
    entry_point: str

    def program(self, completion: str) -> str:
        """The program run in the sandbox for a completion of the prompt."""
        return self.assemble(self.prompt + completion)

    def assemble(self, solution: str) -> str:
        """`solution` (source defining the entry point) + the tests + the call of check."""
        return f"{solution}\n\n{self.test}\n\ncheck({self.entry_point})\n"

    @property
    def imports(self) -> str:
        """The prompt's top-level import lines (what a redefined function may rely on)."""
        lines = [line for line in self.prompt.splitlines()
                 if line.startswith(("import ", "from "))]
        return "".join(line + "\n" for line in lines)

    def to_dict(self) -> dict[str, str]:
        return {f: getattr(self, f) for f in FIELDS}


def _problem_from(row: object, where: str) -> Problem:
    if not isinstance(row, dict):
        raise LLMAccelError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [f for f in FIELDS if f not in row]
    if missing:
        raise LLMAccelError(f"{where}: missing field(s) {', '.join(missing)} (a problem "
                            f"has {', '.join(FIELDS)})")
    for f in FIELDS:
        if not isinstance(row[f], str) or not row[f].strip():
            raise LLMAccelError(f"{where}: field {f!r} must be a non-empty string")
    p = Problem(**{f: row[f] for f in FIELDS})
    if not _IDENTIFIER.match(p.entry_point):
        raise LLMAccelError(f"{where}: entry_point {p.entry_point!r} is not a Python name")
    if not re.search(rf"^def\s+{re.escape(p.entry_point)}\s*\(", p.prompt, re.MULTILINE):
        raise LLMAccelError(f"{where}: the prompt does not define {p.entry_point}()")
    if not re.search(r"^def\s+check\s*\(", p.test, re.MULTILINE):
        raise LLMAccelError(f"{where}: the test does not define check(candidate)")
    return p


def parse_problems(lines: list[str], source: str) -> list[Problem]:
    """Problems from JSON lines (blank lines skipped); task ids must be unique."""
    problems: list[Problem] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise LLMAccelError(f"{where}: not valid JSON ({e.msg})") from None
        p = _problem_from(row, where)
        if p.task_id in seen:
            raise LLMAccelError(f"{where}: duplicate task_id {p.task_id!r}")
        seen.add(p.task_id)
        problems.append(p)
    if not problems:
        raise LLMAccelError(f"{source}: no problems")
    return problems


def load_problems(path: str | Path | None = None, limit: int | None = None) -> list[Problem]:
    """The built-in set (None) or a JSON-lines file in the same layout; the first `limit`."""
    if path is None:
        text = resources.files("llmaccel.eval.code").joinpath(BUILTIN).read_text("utf-8")
        problems = parse_problems(text.splitlines(), f"llmaccel/eval/code/{BUILTIN}")
    else:
        p = Path(path).expanduser()
        if not p.is_file():
            raise LLMAccelError(f"problem file '{path}' does not exist")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise LLMAccelError(f"problem file '{path}' is not UTF-8 text") from None
        problems = parse_problems(text.splitlines(), str(path))
    return problems if limit is None else problems[:limit]
