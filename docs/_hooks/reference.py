"""MkDocs hooks: the reference parts generated from the code, and the checks that keep
the documentation true to the code and to the README.

A generated part of a page lies between ``<!-- generated NAME: ... -->`` and
``<!-- end generated NAME -->``, and is committed, so that the page reads the same on
GitHub as on the site: ``config-reference`` is the table of every config key
(``featcache.config.reference``, read from ``featcache/config/spec.py``), ``cli-synopsis`` the
usage line of every command and ``cli-reference`` the help of every command, both from
the typer app. ``python docs/_hooks/reference.py`` rewrites them from the code.

Each of these is a warning of the build, so ``mkdocs build --strict`` fails on it:

- a generated part that differs from what the code generates now;
- a config key of the spec without a description (the comment beside its field);
- a Sphinx role (``:func:`name```) left as text in a page: docstrings cross-reference
  in Markdown, ``[name][featcache.module.name]``;
- a link to a heading of README.md, or a README section named in quotes
  (``the README's "Install" section``), that README.md does not have.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mkdocs.plugins import get_plugin_logger

log = get_plugin_logger("reference")

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
REGENERATE = "python docs/_hooks/reference.py"
GENERATED = re.compile(
    r"<!-- generated (?P<name>[a-z-]+):[^\n]*-->\n(?P<body>.*?)\n<!-- end generated (?P=name) -->",
    re.DOTALL,
)
# A role as a docstring writes it, or as Markdown renders it (its name in <code>).
ROLE = re.compile(
    r":(?:py:)?(?:func|meth|class|mod|attr|data|exc|obj|const|ref)"
    r":(?:`[^`\n]*`|<code>[^<]*</code>)"
)
README_LINK = re.compile(r"\]\((?P<target>[^)\s]*README\.md(?:#[^)\s]*)?)\)")
README_SECTION = re.compile(r"README(?:\.md)?['’]s\s+[\"“](?P<name>[^\"”]+)[\"”]")


def on_pre_build(config: Any) -> None:
    for key in undocumented_keys():
        log.warning(
            f"config key {key} has no description: comment its field in featcache/config/spec.py"
        )


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    name = page.file.src_uri
    if generate(markdown) != markdown:
        log.warning(f"{name}: its generated parts differ from the code; run `{REGENERATE}`")
    for problem in dead_readme_references(markdown):
        log.warning(f"{name}: {problem}")
    return markdown


def on_page_content(html_text: str, page: Any, config: Any, files: Any) -> str:
    for role in sorted(set(raw_roles(html_text))):
        log.warning(
            f"{page.file.src_uri}: raw Sphinx role {html.unescape(role)}; write a Markdown "
            "cross-reference, [name][featcache.module.name], or the name in backticks"
        )
    return html_text


def generators() -> dict[str, Callable[[], str]]:
    """What each generated part holds, by name."""
    from featcache.config.reference import markdown as config_reference

    return {
        "config-reference": config_reference,
        "cli-synopsis": cli_synopsis,
        "cli-reference": cli_reference,
    }


def generate(text: str) -> str:
    """``text`` with each of its generated parts as the code generates it now."""
    made = generators()

    def part(found: re.Match[str]) -> str:
        name = found["name"]
        return f"{begin(name)}\n\n{made[name]().strip()}\n\n<!-- end generated {name} -->"

    return GENERATED.sub(part, text)


def begin(name: str) -> str:
    return f"<!-- generated {name}: `{REGENERATE}` rewrites this part -->"


def pages() -> Iterator[Path]:
    return iter(sorted(DOCS.rglob("*.md")))


def stale_pages() -> list[str]:
    """The pages (relative to docs/) whose generated parts differ from the code's."""
    return [str(p.relative_to(DOCS)) for p in pages() if generate(p.read_text()) != p.read_text()]


def write() -> list[str]:
    """Rewrite the generated parts of every page from the code; the pages changed."""
    changed = stale_pages()
    for page in changed:
        path = DOCS / page
        path.write_text(generate(path.read_text()))
    return changed


def undocumented_keys() -> list[str]:
    """The config keys whose description in the reference is empty."""
    from featcache.config.reference import config_keys

    return [key.path for key in config_keys() if not key.doc.strip()]


def raw_roles(text: str) -> list[str]:
    """The Sphinx roles in ``text`` (a docstring, or a page's HTML)."""
    return ROLE.findall(text)


def readme_anchors() -> dict[str, str]:
    """README.md's headings: the anchor GitHub gives each, and its text."""
    anchors = {}
    fenced = False
    for line in (REPO / "README.md").read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading and not fenced:
            text = heading.group(1)
            slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
            anchors[slug] = text
    return anchors


def dead_readme_references(markdown: str) -> list[str]:
    """The links to README.md headings, and the README sections named in quotes, that
    README.md does not have."""
    anchors = readme_anchors()
    titles = {text.lower() for text in anchors.values()}
    dead = []
    for found in README_LINK.finditer(markdown):
        _, _, anchor = found["target"].partition("#")
        if anchor and anchor not in anchors:
            dead.append(f"link to {found['target']}: README.md has no heading #{anchor}")
    for found in README_SECTION.finditer(markdown):
        if " ".join(found["name"].split()).lower() not in titles:
            dead.append(f'README.md has no section "{found["name"]}"')
    return dead


def cli_reference() -> str:
    """Every command, its arguments and options, as Markdown (headings from level 2)."""
    import typer
    from typer.cli import get_docs_for_click

    from featcache.commands.app import app

    command = typer.main.get_command(app)
    text = get_docs_for_click(obj=command, ctx=typer.Context(command), name="featcache")
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            line = "```text" if fenced else line  # usage lines, not commands to run
        elif line.startswith("#"):
            line = "#" + line  # the page has its own title
        elif not fenced:
            line = _escape_prose(line)
        lines.append(line)
    return "\n".join(lines)


def cli_synopsis() -> str:
    """One usage line per command with every argument and option, as a text block."""
    import typer

    from featcache.commands.app import app

    group = typer.main.get_command(app)
    lines = _usage("featcache", group.params, ["COMMAND", "[ARGS]..."])
    for name, command in group.commands.items():
        if not command.hidden:
            lines += _usage(f"featcache {name}", command.params)
    return "```text\n" + "\n".join(lines) + "\n```"


def _usage(
    prefix: str, params: list[Any], tail: list[str] | None = None, width: int = 90
) -> list[str]:
    """``prefix`` and the words of ``params``, wrapped at ``width`` under the first word
    after the prefix."""
    words = []
    for param in params:
        if param.hidden:
            continue
        if param.param_type_name == "argument":
            word = param.name.upper()
            word = word if param.required else f"[{word}]"
            words.append(word + ("..." if param.nargs == -1 else ""))
            continue
        flag = max(param.opts, key=len)  # the long form
        if param.secondary_opts:
            word = f"{flag}/{max(param.secondary_opts, key=len)}"
        elif param.is_flag:
            word = flag
        else:
            word = f"{flag} {param.metavar or flag.lstrip('-').replace('-', '_').upper()}"
        word = word if param.required else f"[{word}]"
        words.append(word + ("..." if param.multiple else ""))
    lines, line = [], prefix
    for word in [*words, *(tail or [])]:
        if len(line) + 1 + len(word) > width and line.strip():
            lines.append(line)
            line = " " * len(prefix)
        line += " " + word
    return [*lines, line]


def _escape_prose(line: str) -> str:
    """Help text with ``<placeholders>`` shown as text, not read as HTML tags; the code
    spans (``config <path>``) as they are."""
    parts = re.split(r"(`[^`]*`)", line)
    return "".join(
        part if part.startswith("`") else html.escape(part, quote=False) for part in parts
    )


if __name__ == "__main__":
    for changed in write():
        print(f"rewrote docs/{changed}")
