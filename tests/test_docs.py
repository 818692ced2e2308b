"""The documentation keeps up with the code: every code block of its pages runs (or says
why not), every config key of the spec is in the generated reference, and every page is
in the site's navigation."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from featcache.config.spec import Spec, load_config
from featcache.config.yaml_io import read_yaml

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


def config_page() -> str:
    """docs/reference/config.md as committed: its tables are generated into it."""
    return (DOCS / "reference" / "config.md").read_text()


def test_every_config_key_is_in_the_generated_reference_with_its_default():
    page = config_page()
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


def test_every_config_key_has_a_description():
    """Each key's comment in featcache/config/spec.py is its description in the reference (and
    an empty one is a warning of the strict build)."""
    from featcache.config.reference import config_keys

    assert load_hooks().undocumented_keys() == []
    for key in config_keys():
        assert key.doc.strip() and key.type and key.default and key.allowed, key


def test_the_generated_pages_are_as_the_code_generates_them():
    """The reference pages are committed with their generated parts (so they read the
    same on GitHub); `python docs/_hooks/reference.py` rewrites them, and the strict build
    fails on a stale one."""
    hooks = load_hooks()
    assert hooks.stale_pages() == []
    generated = {
        page: [found["name"] for found in hooks.GENERATED.finditer((DOCS / page).read_text())]
        for page in ("reference/config.md", "reference/cli.md")
    }
    assert generated == {
        "reference/config.md": ["config-reference"],
        "reference/cli.md": ["cli-synopsis", "cli-reference"],
    }


def test_a_key_added_to_the_spec_makes_the_reference_stale(monkeypatch):
    """The reference is generated from the spec, not written by hand: a key added to
    the spec is missing from the committed page until it is regenerated, and is in it
    then with its comment and default."""
    from featcache.config import spec

    @dataclasses.dataclass
    class Wider(spec.StoreSpec):
        shuffle_rows: bool = False  # a key the spec does not have

    hooks = load_hooks()
    assert "`store.shuffle_rows`" not in config_page()
    monkeypatch.setattr(Spec, "__annotations__", {**Spec.__annotations__, "store": Wider})
    assert hooks.stale_pages() == ["reference/config.md"]
    regenerated = hooks.generate(config_page())
    row = next(line for line in regenerated.splitlines() if "store.shuffle_rows" in line)
    assert "a key the spec does not have" in row and "`false`" in row


def test_the_cli_synopsis_names_every_option_of_every_command():
    """The synopsis at the top of the command-line reference: one entry per command,
    naming each of its arguments and options."""
    import typer

    from featcache.commands.app import app

    page = (DOCS / "reference" / "cli.md").read_text()
    synopsis = next(b for b in code_blocks("reference/cli.md") if b.language == "text").code
    usage: dict[str, str] = {}
    for line in synopsis.splitlines():
        if line.startswith("featcache "):
            command = line.split()[1]
        usage[command] = usage.get(command, "") + " " + line
    group = typer.main.get_command(app)
    for name, command in group.commands.items():  # type: ignore[attr-defined]
        assert name in usage, f"{name} is missing from the synopsis"
        for param in command.params:
            names = [param.name.upper()] if param.param_type_name == "argument" else param.opts
            named = (re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", usage[name]) for n in names)
            assert any(named), f"featcache {name}: {names} missing from the synopsis"
    assert "--update" in usage["extract"] and "--limit" in usage["extract"]
    assert page.index("```text") < page.index("Errors are one line")


def test_every_page_is_in_the_navigation():
    in_nav = set(nav_pages())
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert on_disk <= in_nav, sorted(on_disk - in_nav)
    assert in_nav <= on_disk, sorted(in_nav - on_disk)


def api_objects() -> dict[str, typing.Any]:
    """The objects the Python API page documents (its ``::: featcache...`` lines)."""
    found = {}
    for line in (DOCS / "reference" / "api.md").read_text().splitlines():
        if line.startswith("::: "):
            found[line[4:].strip()] = resolve(line[4:].strip())
    return found


def resolve(dotted: str) -> typing.Any:
    """The object a dotted name names: its longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def documented_docstrings() -> typing.Iterator[tuple[str, str]]:
    """The docstrings the API page shows: each object's, and its public members'."""
    for ident, obj in api_objects().items():
        yield ident, inspect.getdoc(obj) or ""
        if inspect.isclass(obj):
            for name, member in vars(obj).items():
                if not name.startswith("_") or name == "__init__":
                    yield f"{ident}.{name}", getattr(member, "__doc__", None) or ""


def test_the_api_docstrings_cross_reference_in_markdown():
    """The API page renders docstrings as Markdown: a Sphinx role (:func:`x`) would show as
    text, so they cross-reference as [x][featcache.module.x] (and the strict build warns
    on a role left in any page)."""
    roles = load_hooks().raw_roles
    found = {ident: roles(doc) for ident, doc in documented_docstrings() if roles(doc)}
    assert found == {}


def test_the_api_page_documents_what_the_package_exports_and_the_docs_use():
    """Every public name of ``featcache``, every name a page's Python imports from
    featcache, and every featcache function or class a page names in code
    (`featcache.probe.nearest`) is on the Python API page."""
    import featcache

    documented = {id(obj) for obj in api_objects().values()}
    named = {f"featcache.{name}" for name in featcache.__all__}
    for page in nav_pages():
        if page == "reference/api.md":
            continue
        for block in code_blocks(page):
            if block.language == "python":
                for module, names in re.findall(
                    r"from (featcache[\w.]*) import ([\w, ]+)", block.code
                ):
                    named |= {f"{module}.{name.strip()}" for name in names.split(",")}
        text = (DOCS / page).read_text()
        named |= set(re.findall(r"`(featcache(?:\.\w+)+)(?:\([^`]*\))?`", text))
    missing = []
    for name in sorted(named):
        obj = resolve(name)
        if inspect.ismodule(obj):
            continue
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            obj = type(obj)  # an instance (featcache.pad_tokens): its class
        if obj.__module__.startswith("featcache") and id(obj) not in documented:
            missing.append(name)
    assert missing == [], missing


def test_references_into_the_readme_name_its_headings():
    """README.md lies outside docs/, so MkDocs does not check links into it: the hook
    does, for links to its headings and for its sections named in quotes."""
    hooks = load_hooks()
    for page in nav_pages():
        assert hooks.dead_readme_references((DOCS / page).read_text()) == [], page
    assert hooks.dead_readme_references("[install](../README.md#install)") == []
    assert hooks.dead_readme_references('the README\'s "Quick start" section') == []
    assert hooks.dead_readme_references("[x](../README.md#configuration)") != []
    assert hooks.dead_readme_references('See the README\'s "Linear\nprobes" section') != []


def test_the_hook_finds_sphinx_roles_as_written_and_as_rendered():
    roles = load_hooks().raw_roles
    assert roles("see :meth:`FeatureDataset.batches`.") == [":meth:`FeatureDataset.batches`"]
    assert roles("(:class:<code>~featcache.config.spec.Spec</code>)") != []
    assert roles("[`batches`][featcache.read.dataset.FeatureDataset.batches], `attr`") == []
