"""How the command line speaks: terminal-safe lines, and every error as one line."""

from __future__ import annotations

import functools
import os
import sys
import traceback
import unicodedata
import warnings
from collections.abc import Callable
from typing import Any

import typer

from featcache.errors import FeatcacheError, FeatcacheWarning, IncompleteStoreError, first_line

state = {"debug": False}  # set by the --debug option


def terminal_safe(text: str) -> str:
    """``text`` with control and format characters but newline and tab written as escapes
    (``\\x1b``): a name in a store, which is data, must not move the cursor or rewrite a
    line already printed (a ``FAIL`` made to read ``ok``)."""
    if text.isprintable():
        return text
    return "".join(
        ch if ch in "\n\t" or unicodedata.category(ch) not in ("Cc", "Cf") else ascii(ch)[1:-1]
        for ch in text
    )


def say(text: str, err: bool = False) -> None:
    """Print a line (to stderr with ``err``), made :func:`terminal_safe`."""
    typer.echo(terminal_safe(text), err=err)


def friendly(command: Callable[..., Any]) -> Callable[..., Any]:
    """Turn errors into one line on stderr: exit 2 for usage/config, 1 for runtime."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", FeatcacheWarning)
                try:
                    return command(*args, **kwargs)
                finally:
                    for warning in caught:
                        _show_warning(warning)
        except typer.Exit:
            raise
        except KeyboardInterrupt:
            say("featcache: interrupted", err=True)
            raise typer.Exit(130) from None
        except BrokenPipeError:  # the reader of stdout stopped (`| head`): stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(0) from None
        except Exception as exc:
            if state["debug"]:
                traceback.print_exc()
            code = exc.exit_code if isinstance(exc, FeatcacheError) else 1
            unexpected = f"{first_line(exc, with_type=True)} (rerun with --debug for the traceback)"
            message = str(exc) if isinstance(exc, FeatcacheError) else unexpected
            if isinstance(exc, IncompleteStoreError):  # the fix a command line offers
                message = (
                    f"store {exc.path} is incomplete ({exc.rows} rows written); rerun its "
                    f"extraction to resume it (`featcache info {exc.path}` prints the command)"
                )
            say(f"featcache: error: {message}", err=True)
            raise typer.Exit(code) from None

    return wrapper


def _show_warning(warning: warnings.WarningMessage) -> None:
    """featcache's own warnings as ``featcache: warning:`` lines; another library's (a
    beta notice, a deprecation) only with ``--debug``, named as theirs."""
    if issubclass(warning.category, FeatcacheWarning):
        say(f"featcache: warning: {warning.message}", err=True)
    elif state["debug"]:
        where = f"{warning.filename}:{warning.lineno}"
        say(f"{warning.category.__name__} from {where}: {warning.message}", err=True)
