"""The ``nedolm-sft`` command-line app: composes the nedolm packages into one tool."""

from importlib.metadata import version

__version__ = version("nedolm-sft")
