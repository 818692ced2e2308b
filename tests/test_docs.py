"""The documentation keeps up with the code: every config key of the spec is in the
generated reference, and the site's pages are all in its navigation."""

from __future__ import annotations

import dataclasses
import importlib.util
import typing
from pathlib import Path

import yaml

from featcache.spec import Spec

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


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
        if dataclasses.is_dataclass(hint):
            keys |= spec_keys(hint, f"{path}.")  # type: ignore[arg-type]
        elif typing.get_origin(hint) is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):
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
        if default is None and key != "layers[].name":
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
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())

    def pages(nav: typing.Any) -> list[str]:
        if isinstance(nav, str):
            return [nav]
        if isinstance(nav, dict):
            return [page for value in nav.values() for page in pages(value)]
        return [page for item in nav for page in pages(item)]

    in_nav = set(pages(config["nav"]))
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert on_disk <= in_nav, sorted(on_disk - in_nav)
    assert in_nav <= on_disk, sorted(in_nav - on_disk)
