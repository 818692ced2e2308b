"""MkDocs hooks: the reference pages generated from the code.

``<!-- config-reference -->`` in a page becomes the table of every config key
(:mod:`featcache.config_reference`, read from ``featcache/spec.py``), and
``<!-- cli-reference -->`` the help of every command, generated from the typer app by
typer's own documentation generator.
"""

from __future__ import annotations

import html
import re
from typing import Any

CONFIG_MARKER = "<!-- config-reference -->"
CLI_MARKER = "<!-- cli-reference -->"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if CONFIG_MARKER in markdown:
        from featcache.config_reference import markdown as config_reference

        markdown = markdown.replace(CONFIG_MARKER, config_reference())
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    return markdown


def cli_reference() -> str:
    """Every command, its arguments and options, as Markdown (headings from level 2)."""
    import typer
    from typer.cli import get_docs_for_click

    from featcache.cli import app

    command = typer.main.get_command(app)
    text = get_docs_for_click(obj=command, ctx=typer.Context(command), name="featcache")
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif line.startswith("#"):
            line = "#" + line  # the page has its own title
        elif not fenced:
            line = _escape_prose(line)
        lines.append(line)
    return "\n".join(lines)


def _escape_prose(line: str) -> str:
    """Help text with ``<placeholders>`` shown as text, not read as HTML tags; the code
    spans (``config <path>``) as they are."""
    parts = re.split(r"(`[^`]*`)", line)
    return "".join(
        part if part.startswith("`") else html.escape(part, quote=False) for part in parts
    )
