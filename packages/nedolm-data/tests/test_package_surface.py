"""``import nedolm.data``: the public API in one place, without torch until a loader name is used."""

from __future__ import annotations

import subprocess
import sys

import pytest

import nedolm.data


def _run(code: str) -> str:
    """Run ``code`` in a fresh interpreter (this one has imported torch long ago)."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_does_not_import_torch() -> None:
    out = _run(
        "import sys, nedolm.data\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
        "print(sorted(m for m in sys.modules if m.startswith('nedolm.data.')))"
    )
    torch_modules, data_modules = out.splitlines()
    assert torch_modules == "[]"
    assert "nedolm.data.loader" not in data_modules
    assert "nedolm.data.builder" in data_modules  # the eager part really was imported


def test_loader_name_imports_torch_on_first_use() -> None:
    out = _run(
        "import sys\n"
        "from nedolm.data import build_sft_loader\n"
        "from nedolm.data.loader import build_sft_loader as direct\n"
        "print(build_sft_loader is direct, 'torch' in sys.modules)"
    )
    assert out.split() == ["True", "True"]


def test_every_public_name_resolves_to_its_module_object() -> None:
    for name in nedolm.data.__all__:
        value = getattr(nedolm.data, name)
        owner = sys.modules[value.__module__]
        assert getattr(owner, name) is value, name
    assert sorted(nedolm.data.__all__) == nedolm.data.__all__
    assert set(nedolm.data.__all__) <= set(dir(nedolm.data))


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'build_sft_laoder'"):
        nedolm.data.build_sft_laoder  # noqa: B018 - the typo is the point
