"""The documentation keeps up with the code: every code block of its pages runs (or says
why not), every config key of the spec is in the generated reference, and every page is
in the site's navigation."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from featcache.config_yaml import read_yaml
from featcache.spec import Spec, load_config

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
NOT_RUN = re.compile(r"<!-- not run: (?P<reason>\S.*\S) -->$")
CODE = {"python", "sh", "bash", "yaml"}  # blocks that are run; text blocks show output
LANGUAGES = CODE | {"text"}
# What a config fragment of the docs (a data or layers section, say) is completed with
# before it is checked, section by section.
BASE_CONFIG = {"model": {"name": "resnet18"}, "layers": ["layer1"]}


@dataclasses.dataclass
class Block:
    """One fenced code block of a docs page."""

    page: str
    line: int
    language: str
    code: str
    not_run: str | None  # the reason given just above it, if it is not run

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.language})"


def nav_pages() -> list[str]:
    """The pages in the order of the site's navigation."""
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())

    def pages(nav: typing.Any) -> list[str]:
        if isinstance(nav, str):
            return [nav]
        if isinstance(nav, dict):
            return [page for value in nav.values() for page in pages(value)]
        return [page for item in nav for page in pages(item)]

    return pages(config["nav"])


def code_blocks(page: str) -> list[Block]:
    """The fenced blocks of ``page`` (indented ones in lists too), with snippets
    (``--8<-- "path"``) read in as the site build reads them."""
    lines = (DOCS / page).read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = re.match(r"^( *)```(\S*)\s*$", lines[i])
        if opening is None:
            i += 1
            continue
        indent, language = opening.groups()
        end = next(j for j in range(i + 1, len(lines)) if lines[j] == f"{indent}```")
        body = [line[len(indent) :] for line in lines[i + 1 : end]]
        code = "\n".join(_snippet(line) for line in body) + "\n"
        above = NOT_RUN.match(lines[i - 1].strip()) if i else None
        blocks.append(Block(page, i + 1, language, code, above and above["reason"]))
        i = end + 1
    return blocks


def _snippet(line: str) -> str:
    found = re.fullmatch(r'--8<-- "(.+)"', line.strip())
    return (REPO / found.group(1)).read_text().rstrip("\n") if found else line


def all_blocks() -> list[Block]:
    return [block for page in nav_pages() for block in code_blocks(page)]


def test_every_code_block_is_run_or_says_why_not():
    blocks = all_blocks()
    assert len(blocks) > 30
    for block in blocks:
        assert block.language in LANGUAGES, f"{block}: give the block a language"
        if block.language not in CODE:
            assert block.not_run is None, f"{block}: only code blocks are run"
    run = [block for block in blocks if block.language in CODE and block.not_run is None]
    assert {block.language for block in run} >= {"python", "sh", "yaml"}


def check_config(block: Block) -> None:
    """A config block of the docs is a valid config, or valid sections of one."""
    raw = read_yaml(block.code)
    assert isinstance(raw, dict), f"{block}: not a mapping"
    own = ("model", "layers", "preprocess") if "models" in raw else ()  # a config of models
    load_config({**{k: v for k, v in BASE_CONFIG.items() if k not in own}, **raw})


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """A folder to run the docs in: the repository's configs beside it, and a
    ``featcache`` command on the PATH that runs this checkout."""
    (tmp_path / "configs").symlink_to(REPO / "configs")
    bin_dir = tmp_path / ".bin"
    bin_dir.mkdir()
    command = bin_dir / "featcache"
    command.write_text(f'#!/bin/sh\nexec {sys.executable} -m featcache "$@"\n')
    command.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    return tmp_path


def test_the_code_blocks_of_the_docs_run(sandbox):
    """Every block not marked runs, page after page in the order of the navigation and
    each page's blocks in order, in one folder: configs are loaded and checked, shell
    blocks run with bash (the demo first, as Getting started does), Python blocks in
    this process. Each block must finish without an error."""
    for block in all_blocks():
        if block.language not in CODE or block.not_run is not None:
            continue
        if block.language == "yaml":
            check_config(block)
        elif block.language == "python":
            exec(compile(block.code, str(block), "exec"), {"__name__": "__docs__"})
        else:
            done = subprocess.run(
                ["bash", "-e", "-o", "pipefail", "-c", block.code],
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert done.returncode == 0, f"{block} failed:\n{done.stdout}\n{done.stderr}"


def load_hooks():
    """docs/_hooks/reference.py, the MkDocs hooks that generate the reference pages."""
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "_hooks" / "reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def spec_keys(cls: type = Spec, prefix: str = "") -> dict[str, typing.Any]:
    """Every leaf key of the config as ``--set`` names it, with its default, walked from
    the dataclasses themselves (``layers[].name`` for the keys of a layer entry)."""
    keys: dict[str, typing.Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint, path = hints[f.name], f"{prefix}{f.name}"
        nested = prefix != "models[]."  # a model's sections are those above, not repeated
        if nested and dataclasses.is_dataclass(hint):
            keys |= spec_keys(hint, f"{path}.")  # type: ignore[arg-type]
        elif (
            nested
            and typing.get_origin(hint) is list
            and dataclasses.is_dataclass(typing.get_args(hint)[0])
        ):
            keys |= spec_keys(typing.get_args(hint)[0], f"{path}[].")
        elif f.default is not dataclasses.MISSING:
            keys[path] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            keys[path] = f.default_factory()
        else:
            keys[path] = None  # required
    return keys


def rendered_config_page() -> str:
    page = (DOCS / "reference" / "config.md").read_text()
    return load_hooks().on_page_markdown(page, None, None, None)


def test_every_config_key_is_in_the_generated_reference_with_its_default():
    page = rendered_config_page()
    rows = {
        line.split("|")[1].strip().strip("`"): line
        for line in page.splitlines()
        if line.startswith("| `")
    }
    keys = spec_keys()
    assert len(keys) > 40
    assert set(rows) == set(keys)
    for key, default in keys.items():
        cell = rows[key].split("|")[3].strip().strip("`")
        if default is None and key not in ("layers[].name", "models[].key"):
            assert cell == "null", key
        elif isinstance(default, bool):
            assert cell == str(default).lower(), key
        elif isinstance(default, (int, str)):
            assert cell == str(default), key


def test_a_key_added_to_the_spec_appears_in_the_reference(monkeypatch):
    """The reference is read from the spec at build time, not written by hand."""
    from featcache import spec

    @dataclasses.dataclass
    class Wider(spec.StoreSpec):
        shuffle_rows: bool = False  # a key the spec does not have

    assert "`store.shuffle_rows`" not in rendered_config_page()
    monkeypatch.setattr(Spec, "__annotations__", {**Spec.__annotations__, "store": Wider})
    row = next(line for line in rendered_config_page().splitlines() if "store.shuffle_rows" in line)
    assert "a key the spec does not have" in row and "`false`" in row


def test_every_page_is_in_the_navigation():
    in_nav = set(nav_pages())
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert on_disk <= in_nav, sorted(on_disk - in_nav)
    assert in_nav <= on_disk, sorted(in_nav - on_disk)
