"""The ``nedolm-sft`` command-line app: composes the nedolm packages into one tool."""

from __future__ import annotations


def __getattr__(name: str) -> str:
    # Read lazily: importlib.metadata costs ~0.1 s, which ``nedolm-sft run`` would spend before
    # its stop-signal handlers are installed (``nedolm_sft.cli``).
    if name == "__version__":
        from importlib.metadata import version

        return version("nedolm-sft")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
