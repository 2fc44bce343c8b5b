"""Tokenizers and chat templates through transformers, for HF directories and GGUF files."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from llmaccel.errors import LLMAccelError
from llmaccel.models.config import ModelConfig

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def get_tokenizer(mc: ModelConfig, tokenizer: str | None = None) -> PreTrainedTokenizerBase:
    """The model's own tokenizer, or `tokenizer` (a path or hub id) when given."""
    if tokenizer is not None:
        _check_tokenizer_name(tokenizer)
        args, kwargs = (str(Path(tokenizer).expanduser()),), {}
    elif mc.source.kind == "gguf":
        directory, file = mc.source.gguf_dir_and_file
        args, kwargs = (directory,), {"gguf_file": file}
    elif mc.source.kind == "hf":
        if not any((mc.source.path / f).is_file() for f in _TOKENIZER_FILES):
            files = ", ".join(_TOKENIZER_FILES)
            raise LLMAccelError(f"'{mc.name}' has no tokenizer files ({files}); pass one with "
                                "--tokenizer PATH_OR_HUB_ID")
        args, kwargs = (str(mc.source.path),), {}
    else:
        raise LLMAccelError(f"'{mc.name}' is a shape with random weights and no tokenizer; "
                            "pass one with --tokenizer PATH_OR_HUB_ID")
    try:
        return AutoTokenizer.from_pretrained(*args, **kwargs)
    except Exception as e:
        detail = " ".join(str(e).split()) or repr(e)
        if tokenizer is not None and not Path(tokenizer).expanduser().exists():
            raise LLMAccelError(f"no such file or directory: {tokenizer}; as a hub id: "
                                f"{detail}") from e
        raise LLMAccelError(f"cannot load the tokenizer of '{tokenizer or mc.name}': {detail}") \
            from e


def _check_tokenizer_name(tokenizer: str) -> None:
    """A --tokenizer that is neither an existing path nor spelled like a hub id is a path
    error, said as one before anything about hub ids."""
    from llmaccel.models.source import could_be_hub_id

    if not Path(tokenizer).expanduser().exists() and not could_be_hub_id(tokenizer):
        raise LLMAccelError(f"no such file or directory: {tokenizer}")


def eos_token_ids(mc: ModelConfig, tok: PreTrainedTokenizerBase | None) -> set[int]:
    """Every id that ends generation: config, generation_config.json and tokenizer eos."""
    ids: set[int] = set()

    def add(value) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    add(getattr(mc.hf_config, "eos_token_id", None))
    if mc.source.kind == "hf" and (mc.source.path / "generation_config.json").is_file():
        try:
            add(json.loads((mc.source.path / "generation_config.json").read_text())
                .get("eos_token_id"))
        except json.JSONDecodeError:
            pass  # a broken generation_config.json only loses extra stop ids
    if tok is not None:
        add(tok.eos_token_id)
    return ids


def format_prompt(tok: PreTrainedTokenizerBase, prompt: str, chat: bool | None) -> list[int]:
    """Token ids of a prompt, wrapped in the chat template when asked (None: if one exists)."""
    has_template = bool(getattr(tok, "chat_template", None))
    if chat and not has_template:
        raise LLMAccelError("this tokenizer has no chat template; use --raw")
    if chat or (chat is None and has_template):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                      add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tok(prompt).input_ids
