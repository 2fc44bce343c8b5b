"""Resolve what the user named as a model into a local source: HF directory, GGUF file or shape."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from llmaccel.errors import LLMAccelError, ModelNotFoundError
from llmaccel.models.shapes import SHAPES, shape_names

SourceKind = Literal["hf", "gguf", "shape"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a hub download needs: configs, weights, tokenizer files, chat templates.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]


@dataclass(frozen=True)
class ModelSource:
    name: str          # what the user typed (or the default model's name)
    kind: SourceKind
    path: Path | None  # directory (hf), file (gguf), None (shape)

    @property
    def gguf_dir_and_file(self) -> tuple[str, str]:
        """transformers takes a GGUF model as (directory, gguf_file=name)."""
        assert self.kind == "gguf" and self.path is not None
        return str(self.path.parent), self.path.name


def resolve_model_source(model: str | None) -> ModelSource:
    if model is None:
        from llmaccel.models.default_model import default_model_path
        return ModelSource("SmolLM2-135M-Instruct (default, GGUF Q4_1)", "gguf",
                           default_model_path())
    if model in SHAPES:
        return ModelSource(model, "shape", None)
    path = Path(model).expanduser()
    if path.exists():
        return _local_source(model, path)
    if could_be_hub_id(model):
        try:
            return ModelSource(model, "hf", _download_from_hub(model))
        except ModelNotFoundError as e:  # a mistyped local path reads as a path error first
            raise ModelNotFoundError(f"no such file or directory: {model}; as a hub id: "
                                     f"{e}") from e
    if model.startswith((".", "/", "~")) or "/" in model or model.endswith(".gguf"):
        raise ModelNotFoundError(f"no such file or directory: {model}")
    raise ModelNotFoundError(
        f"unknown model '{model}': not a local path, a hub id (org/name) or a shape name "
        f"({', '.join(shape_names())})")


def could_be_hub_id(name: str) -> bool:
    """`org/name` that is not spelled as a path (./x, /x, ~/x, a.gguf): worth asking the Hub."""
    return bool(_HUB_ID.match(name)) and not name.endswith(".gguf")


def _local_source(name: str, path: Path) -> ModelSource:
    if path.is_file():
        if path.suffix == ".gguf":
            return ModelSource(name, "gguf", path.resolve())
        if path.name == "config.json":
            return ModelSource(name, "hf", path.parent.resolve())
        raise ModelNotFoundError(f"'{name}' is a file but neither a .gguf file nor config.json")
    if (path / "config.json").is_file():
        return ModelSource(name, "hf", path.resolve())
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(name, "gguf", ggufs[0].resolve())
    if ggufs:
        raise ModelNotFoundError(f"directory '{name}' holds several .gguf files; name one of them")
    raise ModelNotFoundError(f"directory '{name}' has no config.json and no .gguf file")


def _download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError)
    except ImportError as e:  # pragma: no cover - huggingface_hub is a dependency
        raise LLMAccelError(f"huggingface_hub is needed to load hub ids: {e}") from e
    try:  # a cached snapshot works offline
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS,
                                      local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except GatedRepoError as e:
        raise ModelNotFoundError(f"hub model '{repo_id}' is gated: accept its license on "
                                 "huggingface.co and log in (hf auth login)") from e
    except RepositoryNotFoundError as e:
        raise ModelNotFoundError(f"hub model '{repo_id}' does not exist (or is private)") from e
    except Exception as e:  # connection errors come in many types; all mean "unreachable"
        raise ModelNotFoundError(
            f"cannot reach the Hugging Face Hub to download '{repo_id}' and it is not cached; "
            "pass a local path instead (a directory with config.json and *.safetensors, "
            "or a .gguf file)") from e
