"""Secrets out of everything a run writes or logs: params go to MLflow, ``params.json`` and every checkpoint's
``state.json`` redacted, by key and by value.

A key names a secret when one of its words is a secret word (``token``, ``password``, ``private_key``, ``auth``…);
its value, and every other occurrence of that value in any string of the tree, becomes ``***``. Credentials inside
URLs (``postgresql://admin:pw@host/db``) are redacted wherever they appear. Lists and dicts inside lists are walked.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

__all__ = ["flatten", "redact", "REDACTED"]

REDACTED = "***"
_SECRET_WORDS = {"token", "secret", "password", "passwd", "pwd", "passphrase", "apikey", "auth", "authorization",
                 "credential", "credentials", "cookie", "signature"}
_SECRET_PHRASES = ("api_key", "access_key", "private_key", "secret_key", "session_key")
# A URL's userinfo runs to the authority's last '@' (a password may hold '@' itself); "user:password" keeps the user,
# a token alone (http://ghp_TOKEN@host) is all secret.
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<userinfo>[^/\s?#]*)@", re.I)


def _url_secret(m: re.Match) -> str:
    user, sep, pw = m.group("userinfo").partition(":")
    return pw if sep else user


def _url_redacted(m: re.Match) -> str:
    user, sep, pw = m.group("userinfo").partition(":")
    if not (pw if sep else user):
        return m.group(0)
    return f"{m.group('scheme')}{user}:{REDACTED}@" if sep else f"{m.group('scheme')}{REDACTED}@"


def _is_secret_key(key: str) -> bool:
    """``hf_token``, ``api-key``, ``DB_PASSWORD``, ``private_key``: yes; ``tokenizer``, ``max_tokens``: no."""
    k = re.sub(r"[^a-z0-9]+", "_", str(key).lower()).strip("_")
    return bool(_SECRET_WORDS & set(k.split("_"))) or any(p in k for p in _SECRET_PHRASES)


def _secret_values(tree: Any, out: set[str]) -> set[str]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            if _is_secret_key(k) and isinstance(v, (str, int, float)) and str(v):
                out.add(str(v))
            _secret_values(v, out)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            _secret_values(v, out)
    elif isinstance(tree, str):
        out.update(_url_secret(m) for m in _URL_CREDENTIALS.finditer(tree) if _url_secret(m))
    return out


def _redact(tree: Any, secrets: list[str]) -> Any:
    if isinstance(tree, dict):
        return {k: REDACTED if _is_secret_key(k) and v not in (None, "", {}, []) else _redact(v, secrets)
                for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_redact(v, secrets) for v in tree]
    if isinstance(tree, str):
        s = _URL_CREDENTIALS.sub(_url_redacted, tree)
        for secret in secrets:
            s = s.replace(secret, REDACTED)
        return s
    return tree


def redact(tree: Any) -> Any:
    """A copy of ``tree`` (dicts, lists, scalars) with every secret replaced by ``***``."""
    secrets = sorted((s for s in _secret_values(tree, set()) if len(s) >= 4), key=len, reverse=True)
    return _redact(tree, secrets)


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}`` (empty mappings stay as values)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
