"""The config reference, read from the spec's dataclasses and the comments beside their
fields (``featcache/config/spec.py``): a key added to the spec appears without more edits."""

from __future__ import annotations

import ast
import dataclasses
import html
import inspect
import io
import json
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator
from typing import Any

from featcache.config import spec as spec_module
from featcache.config.spec import DataSpec, Spec
from featcache.config.validation import allowed_values


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    """One config key: ``path`` as written in ``--set`` (``loader.batch_size``; the keys
    of each ``layers`` entry as ``layers[].name``), its type, default and allowed values
    in words, and what the spec's comments say about it."""

    section: str
    path: str
    type: str
    default: str
    allowed: str
    doc: str


def config_keys() -> list[KeyDoc]:
    """Every key of :class:`~featcache.config.spec.Spec`, section by section, in spec order."""
    rows: list[KeyDoc] = []
    hints = typing.get_type_hints(Spec)
    for section in dataclasses.fields(Spec):
        hint = hints[section.name]
        if typing.get_origin(hint) is list:  # layers: a list of LayerSpec mappings
            (item,) = typing.get_args(hint)
            rows += _keys_of(item, section.name, f"{section.name}[]")
        else:
            rows += _keys_of(hint, section.name, section.name)
    return rows


def section_docs() -> dict[str, str]:
    """The docstring of each section's dataclass (first paragraph), by section name."""
    hints = typing.get_type_hints(Spec)
    docs = {}
    for section in dataclasses.fields(Spec):
        cls = hints[section.name]
        if typing.get_origin(cls) is list:
            (cls,) = typing.get_args(cls)
        doc = inspect.getdoc(cls) or ""
        if doc and not doc.startswith(f"{cls.__name__}("):  # dataclass's generated signature
            docs[section.name] = " ".join(doc.split("\n\n")[0].split())
    return docs


def markdown() -> str:
    """The reference as Markdown: one table per section."""
    out = io.StringIO()
    docs = section_docs()
    section = None
    for key in config_keys():
        if key.section != section:
            section = key.section
            out.write(f"\n### `{section}`\n\n")
            if section in docs:
                out.write(f"{docs[section]}\n\n")
            out.write("| key | type | default | allowed | description |\n")
            out.write("|---|---|---|---|---|\n")
        cells = (f"`{key.path}`", _text(key.type), f"`{key.default}`", _text(key.allowed))
        out.write("| " + " | ".join([*cells, _text(key.doc)]) + " |\n")
    return out.getvalue()


def _keys_of(cls: type, section: str, prefix: str) -> Iterator[KeyDoc]:
    hints = typing.get_type_hints(cls)
    comments = _field_comments(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        doc = comments.get(f.name, "")
        if cls is DataSpec and f.name in spec_module._READ_BY:  # keys only some sources read
            sources = ", ".join(spec_module._READ_BY[f.name])
            doc = f"{doc.rstrip('.')}. Read by: {sources}." if doc else f"Read by: {sources}."
        yield KeyDoc(
            section=section,
            path=f"{prefix}.{f.name}",
            type=_type_name(hint),
            default=_default(f),
            allowed=allowed_values(hint, f.metadata.get("bounds")),
            doc=doc,
        )


def _type_name(hint: Any) -> str:
    """``int or "auto"``, ``list[float] or null``: the hint in config words."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(_type_name(alt) for alt in typing.get_args(hint)))
    if origin is typing.Literal:
        return "choice"
    if origin in (list, tuple):
        args = typing.get_args(hint)
        return f"list[{_type_name(args[0])}]" if args else "list"
    if origin is dict or hint is dict or dataclasses.is_dataclass(hint):  # a dataclass: models[]
        return "mapping"
    names = {str: "str", int: "int", float: "float", bool: "bool", type(None): "null", Any: "any"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return "{}"
    return json.dumps(value) if not isinstance(value, str) else value


def _field_comments(cls: type) -> dict[str, str]:
    """The comments that document each field of ``cls`` in its source: the lines of
    comments right above the field and the comment at the end of its line."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    lines = source.splitlines()
    (node,) = ast.parse(source).body
    assert isinstance(node, ast.ClassDef)
    found: dict[str, str] = {}
    for statement in node.body:
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        above: list[str] = []
        row = statement.lineno - 1
        while row in comments and lines[row - 1].lstrip().startswith("#"):
            above.insert(0, comments[row])
            row -= 1
        end = statement.end_lineno or statement.lineno
        trailing = [comments[n] for n in range(statement.lineno, end + 1) if n in comments]
        found[statement.target.id] = " ".join([*above, *trailing])
    return found


def _text(text: str) -> str:
    """``text`` as the literal content of a Markdown table cell (no HTML, no emphasis)."""
    text = html.escape(text, quote=False).replace("\n", " ")
    for special in "|*_`[]":
        text = text.replace(special, "\\" + special)
    return text
