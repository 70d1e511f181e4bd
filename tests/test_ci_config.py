"""The repository's CI entry points agree with what they promise: `.ci/run` runs the README's
test command verbatim, and GitHub's workflow runs every tox env of the envlist (the imports-*
envs, each package alone, were once left out of it)."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def expand_braces(spec: str) -> list[str]:
    """tox's ``a-{b,c}`` factor syntax: ``["a-b", "a-c"]`` (one group per name, as tox.ini uses)."""
    match = re.fullmatch(r"(.*)\{([^{}]*)\}(.*)", spec)
    if not match:
        return [spec]
    head, choices, tail = match.groups()
    return [f"{head}{choice.strip()}{tail}" for choice in choices.split(",")]


def split_envlist(envlist: str) -> list[str]:
    """Commas inside braces belong to the factor group, not the list."""
    return [spec.strip() for spec in re.split(r",\s*(?![^{]*\})", envlist) if spec.strip()]


def test_expand_braces_and_split_envlist() -> None:
    assert split_envlist("dist, lint, imports-{data,model}") == [
        "dist",
        "lint",
        "imports-{data,model}",
    ]
    assert expand_braces("imports-{data, model}") == ["imports-data", "imports-model"]
    assert expand_braces("lint") == ["lint"]


def test_github_runs_every_tox_env_of_the_envlist() -> None:
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(REPO / "tox.ini")
    envs = {env for spec in split_envlist(tox["tox"]["envlist"]) for env in expand_braces(spec)}
    workflow = yaml.safe_load((REPO / ".github" / "workflows" / "ci.yml").read_text())
    matrix = workflow["jobs"]["tox"]["strategy"]["matrix"]
    ran = set(matrix["env"]) | {row["env"] for row in matrix.get("include", [])}
    assert envs - ran == set(), "tox envs GitHub's workflow does not run"
    assert ran - envs <= {"torch-oldest", "torch-newest"}, "workflow envs tox does not list"


def test_ci_runs_the_readmes_test_command_verbatim() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    commands = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    test_command = commands[1]  # the README's first two commands: the demo, then the tests
    assert "pytest" in test_command, test_command
    ci_lines = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert test_command in ci_lines, f"{test_command!r} is not a line of .ci/run"
