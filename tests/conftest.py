import os
import subprocess
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # No GPU (CI): Triton kernels run in Triton's interpreter. Set here, before any test module
    # (or transformers/torch) imports triton: parts of triton read it at import time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
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
