"""The repository keeps its promises: CI runs exactly the README's test command."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    quick_start = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(?:sh|bash)\n(.+?)\n```", quick_start)


def test_readme_has_the_two_commands_and_ci_runs_the_test_one_verbatim():
    demo, tests = readme_commands()
    assert demo.endswith("featcache demo")
    assert "pytest" in tests
    ci_lines = (REPO / ".ci" / "run").read_text().splitlines()
    assert tests in ci_lines


def test_constraints_pin_the_torch_pair():
    pins = (REPO / "constraints.txt").read_text().split()
    assert "torch==2.13.0" in pins and "torchvision==0.28.0" in pins
