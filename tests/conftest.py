import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # No GPU (CI): Triton kernels run in Triton's interpreter. Set here, before any test module
    # (or transformers/torch) imports triton: parts of triton read it at import time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
# The shared helpers (tiny_models, server_harness, ...) live here and the tests in folders that
# mirror the package; a test imports helpers and other tests' cases by module name.
for _folder in [Path(__file__).resolve().parent,
                *sorted(p for p in Path(__file__).resolve().parent.iterdir()
                        if p.is_dir() and p.name not in ("data", "__pycache__"))]:
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))
FETCH = REPO.parent / "shared" / "models" / "fetch"


def fetch_model(name: str) -> Path:
    """A real GGUF model through ../shared/models/fetch. Missing ../shared skips the test on a
    developer machine but fails in CI, where it must be present."""
    if not FETCH.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{FETCH} is missing in CI")
        pytest.skip("../shared/models/fetch not available")
    out = subprocess.run(["bash", str(FETCH), name], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.fail(f"fetch {name} failed: {out.stderr.strip()}")
    return Path(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return fetch_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf, tmp_path_factory):
    """(HF model, tokenizer, directory) of SmolLM2 as safetensors: converted from the GGUF
    once per session (about 20 s), so engines load it in a second. Do not modify the model."""
    from llmaccel.models.convert import gguf_to_hf_dir

    model_dir = tmp_path_factory.mktemp("smollm2-hf")
    hf, tok = gguf_to_hf_dir(smollm2_gguf, model_dir)
    return hf, tok, model_dir


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# -- text data ---------------------------------------------------------------------------------
_WORDS = ("the model reads every weight once per step and the cache keeps keys and values of "
          "each token so that a long prompt costs memory while a short answer costs time "
          "engineers measure throughput latency and perplexity before they ship a change "
          "quantization stores weights in four or eight bits with a scale for every group").split()


def generated_text(n_paragraphs: int = 400, seed: int = 0) -> str:
    """Deterministic English-like text in WikiText's raw layout (` = Title = ` headings, blank
    lines as ' \\n'): what tests calibrate, train and evaluate on where real text is not needed,
    so they pass on a clone without ../shared."""
    import random

    rng = random.Random(seed)
    lines = []
    for i in range(n_paragraphs):
        if i % 20 == 0:
            lines += [" \n", f" = Section {i // 20} = \n", " \n"]
        words = [rng.choice(_WORDS) for _ in range(rng.randint(40, 120))]
        lines.append(" " + " ".join(words) + " . \n")
    return "".join(lines)


def write_wikitext_dir(root: Path) -> Path:
    """A directory in WikiText-2's layout (wikitext-2-raw/wiki.{train,valid,test}.raw) holding
    generated text."""
    d = root / "wikitext-2-raw"
    d.mkdir(parents=True, exist_ok=True)
    for seed, name in enumerate(("wiki.train.raw", "wiki.valid.raw", "wiki.test.raw")):
        (d / name).write_text(generated_text(seed=seed), encoding="utf-8")
    return root


@functools.lru_cache(maxsize=1)
def generated_wikitext_dir() -> Path:
    """One generated WikiText-layout data directory per test session (pass it as `--data` /
    `data=`; removed at exit)."""
    import atexit
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="llmaccel-generated-text-"))
    atexit.register(shutil.rmtree, root, True)
    return write_wikitext_dir(root)


@pytest.fixture(scope="session")
def wikitext_dir() -> Path:
    return generated_wikitext_dir()
