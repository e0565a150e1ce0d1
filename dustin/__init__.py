"""dustin: long-context, batched speculative decoding with draft-augmented sparse verification.

    from dustin import LLM, SamplingParams

    llm = LLM("default", "default", method="dustin")
    print(llm.generate("def fib(n):", SamplingParams(max_tokens=32))[0].text)

The names below are imported on first use (PEP 562 `__getattr__`): `import dustin` stays cheap (it does not import
torch), which keeps `dustin --help` and tools that only read the package's metadata fast.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["LLM", "RequestResult", "SamplingParams", "__version__"]

# public name -> the module that defines it
_LAZY = {"LLM": "dustin.llm", "RequestResult": "dustin.llm", "SamplingParams": "dustin.engine.request"}

if TYPE_CHECKING:
    from dustin.engine.request import SamplingParams
    from dustin.llm import LLM, RequestResult


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dustin")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0.1.0"


__version__ = _version()


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'dustin' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
