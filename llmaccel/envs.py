"""Every environment variable llmaccel reads, in one place: its type, default and meaning.

Read when asked for (``envs.LLMACCEL_CACHE``), never at import, so a variable set after the
package was imported (by a launcher or a test) takes effect. Booleans take 1/0, true/false,
yes/no or on/off; anything else is an error naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmaccel.errors import LLMAccelError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _bool(name: str, default: bool | None) -> Callable[[], bool | None]:
    def read() -> bool | None:
        value = os.environ.get(name, "").strip().lower()
        if not value:
            return default
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        raise LLMAccelError(f"{name}={os.environ[name]!r}: expected 1 or 0 (true/false, "
                            "yes/no, on/off)")
    return read


def _path(name: str) -> Callable[[], Path | None]:
    return lambda: Path(os.environ[name]).expanduser() if os.environ.get(name) else None


def _str(name: str) -> Callable[[], str | None]:
    return lambda: os.environ.get(name) or None


# name -> (reader, meaning)
environment_variables: dict[str, tuple[Callable[[], Any], str]] = {
    "LLMACCEL_CACHE": (_path("LLMACCEL_CACHE"),
                       "Where downloaded models and datasets are cached (default: the "
                       "platform's user cache directory, e.g. ~/.cache/llmaccel)."),
    "LLMACCEL_DATA_DIR": (_path("LLMACCEL_DATA_DIR"),
                          "A directory searched first for named datasets (wikitext2: "
                          "wiki.test.raw and wiki.valid.raw; tinyshakespeare: input.txt)."),
    "LLMACCEL_NO_SHARED_DATA": (_bool("LLMACCEL_NO_SHARED_DATA", False),
                                "Do not look for datasets in ../shared/data (a development "
                                "checkout's data directory)."),
    "LLMACCEL_GEMM_CONFIGS": (_path("LLMACCEL_GEMM_CONFIGS"),
                              "A kernel tuning table (JSON, in the layout of llmaccel/kernels/configs/) "
                              "used instead of the built-in one for this GPU."),
    "LLMACCEL_CUDA_KERNELS": (_bool("LLMACCEL_CUDA_KERNELS", True),
                              "0: never compile CUDA C kernels at run time (NVRTC); Triton "
                              "and torch kernels are used instead."),
    "LLMACCEL_PDL": (_bool("LLMACCEL_PDL", None),
                     "Programmatic dependent launch between decode kernels: 1 or 0 forces "
                     "it; unset, it is on where the GPU supports it (sm_90 and later)."),
    "LLMACCEL_DEBUG": (_bool("LLMACCEL_DEBUG", False),
                       "The CLI shows full tracebacks for unexpected errors."),
    "LLMACCEL_API_KEY": (_str("LLMACCEL_API_KEY"),
                         "`llmaccel serve`: the key clients must send (as --api-key)."),
    "LLMACCEL_COMMIT": (_str("LLMACCEL_COMMIT"),
                        "The commit benchmark records name, where the checkout has no .git "
                        "(default: git's HEAD)."),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name][0]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(environment_variables)
