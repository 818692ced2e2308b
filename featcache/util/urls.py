"""URLs in a config (a path with a protocol, read through fsspec): how to tell them from
paths, join them, and keep credentials out of the config, which every store records."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from featcache.errors import ConfigError

_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")

# storage_options keys whose values are secrets (matched in lower case, at any depth).
_SECRET_KEY = re.compile(
    r"^(key|secret|password|passwd|token|sas|sig|signature)$"
    r"|secret|password|session_token|access_key|account_key|sas_token|connection_string"
    r"|credential|api_key|private_key|refresh_token|bearer"
)
# Values of a "token" option that name a way to authenticate rather than hold a secret.
_TOKEN_MODES = {"anon", "cloud", "google_default", "browser", "cache"}
# Query parameters of signed URLs (S3 and GCS presigned URLs, Azure SAS tokens).
_SECRET_QUERY = re.compile(
    r"sig|signature|token|key|credential|secret|password|auth|^x-amz-|^x-goog-|^sv$|^se$"
)

WHERE_CREDENTIALS_GO = (
    "where the storage library reads them: its environment variables (AWS_ACCESS_KEY_ID "
    "and AWS_SECRET_ACCESS_KEY for S3), a credentials file with data.storage_options.profile, "
    "or the machine's role; data.storage_options.anon: true reads public data"
)


def is_url(path: object) -> bool:
    """Whether ``path`` is a string with a protocol (``s3://...``)."""
    return isinstance(path, str) and _URL.match(path) is not None


def protocol_of(url: str) -> str:
    """``s3`` for ``s3://bucket/key``."""
    match = _URL.match(url)
    if match is None:
        raise ValueError(f"{url!r} is not a URL")
    return match.group(1).lower()


def join(root: str, name: str) -> str:
    """``name`` under ``root`` (a URL or a local folder); a URL ``name`` stands alone."""
    if is_url(name):
        return name
    if is_url(root):
        return root.rstrip("/") + "/" + name.lstrip("/")
    return os.path.join(os.path.expanduser(root), os.path.expanduser(name))


def relative(url: str, root: str | None) -> str:
    """``url`` relative to the URL ``root`` when it lies under it, else ``url`` itself."""
    if root and is_url(root):
        prefix = root.rstrip("/") + "/"
        if url.startswith(prefix):
            return url[len(prefix) :]
    return url


def parent(url: str) -> str:
    """The URL of the folder ``url`` is in."""
    return url.rstrip("/").rsplit("/", 1)[0]


def check_url(url: str, where: str) -> None:
    """Refuse a URL that carries credentials (``user:password@``, a signed query string).

    Raises:
        ConfigError: naming ``where`` and the URL without its secret part.
    """
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]  # as written, port included, without user:password
    shown = f"{parts.scheme}://{host}{parts.path}"
    if parts.username or parts.password:
        raise ConfigError(
            f"{where}: the URL {shown} carries a user name or password, and stores record "
            f"their URLs; give credentials {WHERE_CREDENTIALS_GO}"
        )
    for name, _ in parse_qsl(parts.query, keep_blank_values=True):
        if _SECRET_QUERY.search(name.lower()):
            raise ConfigError(
                f"{where}: the URL {shown} carries credentials in its query ({name}=...), and "
                f"stores record their URLs; give credentials {WHERE_CREDENTIALS_GO}"
            )


def check_storage_options(options: Any, at: str) -> None:
    """Refuse secret values in ``data.storage_options`` at any depth, naming the key but
    never its value.

    Raises:
        ConfigError: one line saying where credentials go instead.
    """
    if not isinstance(options, Mapping):
        return
    for key, value in options.items():
        where = f"{at}.{key}"
        if isinstance(value, Mapping):
            check_storage_options(value, where)
            continue
        name = str(key).lower()
        harmless = value is None or isinstance(value, bool) or value in _TOKEN_MODES
        if _SECRET_KEY.search(name) and not (name == "token" and harmless):
            raise ConfigError(
                f"{where} would put a credential into the config, which every store "
                f"records; give it {WHERE_CREDENTIALS_GO}"
            )


def scrub(text: str) -> str:
    """``text`` with the values of credential environment variables blanked out."""
    for name, value in os.environ.items():
        if len(value) >= 8 and _SECRET_KEY.search(name.lower()) and value in text:
            text = text.replace(value, "***")
    return text
