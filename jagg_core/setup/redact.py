"""Secrets out of everything a run writes or logs: params go to MLflow, ``params.json`` and every checkpoint's
``state.json`` redacted, by key and by value.

A key names a secret when one of its words is a secret word (``token``, ``password``, ``private_key``, ``auth``…);
its value, whatever its type (a number, a list, a mapping: every value in it), and every other occurrence of that
value in any string of the tree, becomes ``***``. Credentials inside URLs (``postgresql://admin:pw@host/db``) and
the values of a URL's query (``https://h/score?api_key=***``: services take keys and signatures there, so every value
of a query is treated as one) are redacted wherever they appear. Lists and dicts inside lists are walked.
An option that a plugin's spec marks secret (``secret=("seed_phrase",)``, a name the word list cannot know) is
redacted by its path (:func:`mask`, what ``Params.redacted()`` applies) and its value wherever else it occurs.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["flatten", "hide", "holds_secret", "invalid_value", "is_secret_path", "mask", "redact", "redact_own",
           "redact_value", "remember", "REDACTED"]

REDACTED = "***"
_SECRET_WORDS = {"token", "secret", "password", "passwd", "pwd", "passphrase", "apikey", "auth", "authorization",
                 "credential", "credentials", "cookie", "signature"}
_SECRET_PHRASES = ("api_key", "access_key", "private_key", "secret_key", "session_key")
# A URL's userinfo: "user:password" keeps the user, a token alone (http://ghp_TOKEN@host) is all secret. The password
# runs to the last '@' before the URL ends (whitespace, a quote, an angle bracket, a backtick or the next "://"): it
# may hold '@', '/', '#' or '?' as typed (SQLAlchemy and requests take `postgresql://alice:Pa#ss@host/db` as written),
# so the authority's RFC 3986 end is not where a secret ends. A token alone (no ':') holds no '/', '?' or '#', so
# `http://h/a@b` (an '@' in a path) has no credentials; `http://h:80/a@b` is read as user h, password 80/a: too much
# redacted, never too little. A URL made a path (`Path("http://alice:pw@h/p.yaml")` prints `http:/alice:pw@h/p.yaml`:
# a path's `//` collapses to `/`) is still a URL here: the scheme ends with one slash or more.
_URL_CREDENTIALS = re.compile(
    r"(?P<scheme>[a-z][a-z0-9+.-]*:/+)"
    r"(?P<userinfo>[^\s/?#:@\"'<>`]*:(?:(?!://)[^\s\"'<>`])*|[^\s/?#:\"'<>`]*)@", re.I)
# A URL's query (after the path, up to a '#' or where the URL ends): each `name=value` keeps its name, its value is
# `***` (`?api_key=***&v=***`), a value alone is `***` (`?***`). The userinfo is redacted first, so a '?' in a password
# is never taken for the query's start. In one value (a field's input) the query runs to the value's end.
_URL_QUERY = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*:/+[^\s?#\"'<>`]*\?)(?P<query>[^\s#\"'<>`]*)", re.I)
_VALUE_QUERY = re.compile(r"(?P<head>[a-z][a-z0-9+.-]+:/+[^?#]*\?)(?P<query>[^#]*)", re.I | re.S)
# The names of a query's values that are also remembered as secrets on their own (a library may quote them without
# the URL): the secret words, and those a query uses for keys and signatures (`?key=`, `?sig=` of a signed URL)
_QUERY_SECRET_WORDS = {"key", "sig", "code"}
# Pieces of a secret that a library may quote on their own (requests parses `http://alice:Pa/ss@h` as host "alice"
# and path "/ss@h"): every piece between '/', '#', '?', '@' or ':' at least this long is redacted too.
_MIN_PIECE = 6
# The secrets seen in this process (params validated, trees redacted): a log record or an error's text quotes them
# without the key or the URL that marked them as secrets.
_known: set[str] = set()


def _url_secret(m: re.Match) -> str:
    user, sep, pw = m.group("userinfo").partition(":")
    return pw if sep else user


def _url_redacted(m: re.Match) -> str:
    user, sep, pw = m.group("userinfo").partition(":")
    if not (pw if sep else user):
        return m.group(0)
    return f"{m.group('scheme')}{user}:{REDACTED}@" if sep else f"{m.group('scheme')}{REDACTED}@"


def _query_redacted(m: re.Match) -> str:
    parts = []
    for part in re.split(r"([&;])", m.group("query")):
        name, eq, value = part.partition("=")
        parts.append(part if part in ("&", ";", "") else f"{name}={REDACTED}" if eq and value
                     else part if eq else REDACTED)
    return m.group("head") + "".join(parts)


def _query_secrets(text: str) -> set[str]:
    """The values of the URL queries in ``text`` whose names say they are secrets (``api_key``, ``sig``): remembered
    for text that quotes them alone (every query value is redacted inside its URL anyway)."""
    out = set()
    for m in _URL_QUERY.finditer(text):
        for part in re.split(r"[&;]", m.group("query")):
            name, _, value = part.partition("=")
            words = set(re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_").split("_"))
            if value and (_is_secret_key(name) or words & _QUERY_SECRET_WORDS):
                out.add(value)
    return out


def _is_secret_key(key: str) -> bool:
    """``hf_token``, ``api-key``, ``DB_PASSWORD``, ``private_key``: yes; ``tokenizer``, ``max_tokens``: no."""
    k = re.sub(r"[^a-z0-9]+", "_", str(key).lower()).strip("_")
    return bool(_SECRET_WORDS & set(k.split("_"))) or any(p in k for p in _SECRET_PHRASES)


def _secret_values(tree: Any, out: set[str]) -> set[str]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            if _is_secret_key(k):  # whatever its type: a token given as a number, a list or a mapping
                out |= _scalars([v])
            _secret_values(v, out)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            _secret_values(v, out)
    elif isinstance(tree, str):
        out.update(_url_secret(m) for m in _URL_CREDENTIALS.finditer(tree) if _url_secret(m))
        out |= _query_secrets(_URL_CREDENTIALS.sub(_url_redacted, tree))
    return out


def _redact(tree: Any, secrets: list[str]) -> Any:
    if isinstance(tree, dict):
        return {k: REDACTED if _is_secret_key(k) and v not in (None, "", {}, []) else _redact(v, secrets)
                for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_redact(v, secrets) for v in tree]
    if isinstance(tree, str):
        s = _URL_QUERY.sub(_query_redacted, _URL_CREDENTIALS.sub(_url_redacted, tree))
        for secret in secrets:
            s = s.replace(secret, REDACTED)
        return s
    return tree


def _forms(secret: str) -> set[str]:
    """``secret`` and the forms it takes where it is quoted: percent-encoded, and its pieces between URL delimiters."""
    from urllib.parse import quote, unquote

    out = {secret, quote(secret, safe=""), quote(secret), unquote(secret)}
    out.update(p for p in re.split(r"[/#?@:]", secret) if len(p) >= _MIN_PIECE)
    return {f for f in out if len(f) >= 4}


def remember(tree: Any, also: Iterable[Any] = ()) -> None:
    """Keep the secrets of ``tree`` (by key and in URLs), and the values ``also`` (secrets by a plugin's mark, under
    any name: :func:`mask`), for every later :func:`redact` of this process, so a string that quotes one without its
    key or URL (a log record, a library's error) is redacted too."""
    for secret in _secret_values(tree, set()) | _scalars(also):
        if len(secret) >= 4:
            _known.update(_forms(secret))


def _scalars(values: Iterable[Any]) -> set[str]:
    """Every non-empty scalar in ``values`` (lists and dicts walked) as a string."""
    out: set[str] = set()
    for v in values:
        if isinstance(v, dict):
            out |= _scalars(v.values())
        elif isinstance(v, (list, tuple)):
            out |= _scalars(v)
        elif isinstance(v, (str, int, float)) and not isinstance(v, bool) and str(v):
            out.add(str(v))
    return out


def mask(tree: Any, paths: Iterable[Sequence[str]]) -> Any:
    """A copy of ``tree`` with the value at each path (a sequence of keys: ``("reward", "options", "mine", "seed")``)
    ``***``, wherever it is set (not None or empty): secrets that a plugin's spec marks by name (its ``secret``
    options), which the word list of secret keys cannot know. A path not in ``tree`` is left alone."""
    out = copy.deepcopy(tree)
    for path in paths:
        node = out
        for k in path[:-1]:
            node = node.get(k) if isinstance(node, dict) else None
        if isinstance(node, dict) and path and node.get(path[-1]) not in (None, "", {}, []):
            node[path[-1]] = REDACTED
    return out


def redact(tree: Any) -> Any:
    """A copy of ``tree`` (dicts, lists, scalars) with every secret replaced by ``***``: those of ``tree`` itself
    and those this process has seen before (:func:`remember`)."""
    remember(tree)
    secrets = sorted(_known, key=len, reverse=True)
    return _redact(tree, secrets)


def _own_secrets(tree: Any, also: Iterable[Any] = ()) -> list[str]:
    """The secrets ``tree`` itself marks (by key and in URLs), and ``also``, with their quoted forms, longest first:
    not this process's memory, so the answer depends on the arguments alone."""
    forms: set[str] = set()
    for secret in _secret_values(tree, set()) | _scalars(also):
        if len(secret) >= 4:
            forms.update(_forms(secret))
    return sorted(forms, key=len, reverse=True)


def redact_own(tree: Any) -> Any:
    """A copy of ``tree`` with its own secrets ``***`` (by key, in URLs, and wherever else their values occur in it),
    independent of what this process has seen: the same tree always gives the same copy (what a digest may hash)."""
    return _redact(tree, _own_secrets(tree))


# One value that is (or holds) a URL: its userinfo runs to the value's last '@', whatever it holds (a space, a quote),
# where free text (:data:`_URL_CREDENTIALS`) must stop at a space. A scheme has two characters or more: `C:/x@y` is a
# drive's path.
_VALUE_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]+:/+)(?P<userinfo>.*)@", re.I | re.S)


def redact_value(tree: Any) -> Any:
    """:func:`redact` for what is known to be one value each (a params field's input quoted in an error): a URL's
    userinfo is every character up to the value's last '@' (``http://alice:pass word@h`` → ``http://alice:***@h``),
    which free text cannot assume."""
    if isinstance(tree, dict):
        return redact({k: redact_value(v) for k, v in tree.items()})
    if isinstance(tree, (list, tuple)):
        return redact([redact_value(v) for v in tree])
    if isinstance(tree, str):
        return redact(_VALUE_QUERY.sub(_query_redacted, _VALUE_USERINFO.sub(_url_redacted, tree)))
    return tree


def is_secret_path(path: Sequence[str], secret: Iterable[str] = ()) -> bool:
    """Whether a value at ``path`` (its keys, ``("reward", "options", "served", "token")``) is a secret: a key on
    the way is a secret word, or its last is one that a plugin's spec marks (``secret``)."""
    return any(_is_secret_key(k) for k in path) or bool(path and path[-1] in set(secret))


def _kind(value: Any) -> str:
    kinds = {bool: "true/false", int: "a number", float: "a number", str: "a string", list: "a list",
             tuple: "a list", dict: "a mapping", type(None): "nothing"}
    return kinds.get(type(value), type(value).__name__)


def invalid_value(field: str, value: Any, problem: str, secret: Iterable[str] = ()) -> str:
    """``"<field> = <value> is invalid: <problem>"``: the one way an error quotes a value a user gave (a params
    field's input). The value is redacted as one value (:func:`redact_value`) and cut to 100 characters; a secret
    field's (its path holds a secret word, or its name is one of ``secret``: a plugin's marks) is not quoted at all,
    whatever its type (a token given as a number, a list, a mapping or a string too long), only its kind, and
    ``problem`` loses every piece of it."""
    secret = tuple(secret)
    if is_secret_path(field.split("."), secret):
        return f"{field} = {REDACTED} ({_kind(value)}) is invalid: {hide(problem, also=[value])}"
    shown = repr(redact_value(value))
    shown = shown if len(shown) <= 100 else f"{shown[:80]}… ({len(shown):,} characters)"
    return f"{field} = {shown} is invalid: {problem}"


def hide(text: str, tree: Any = None, also: Iterable[Any] = ()) -> str:
    """``text`` (a sentence about ``tree``, e.g. params that failed validation) with every secret of ``tree`` (by
    key, whatever its type, and in URLs) and every value of ``also`` ``***``, independent of what this process has
    seen: params that never validated were never remembered."""
    return _redact(text, _own_secrets(tree, also))


def holds_secret(text: str, tree: Any = None, also: Iterable[Any] = ()) -> bool:
    """Whether ``text`` (one value, e.g. a name) holds a URL's credentials, a secret of ``tree`` (its params) or one
    of the values ``also`` (secrets by a plugin's mark)."""
    if (_VALUE_USERINFO.sub(_url_redacted, text) != text or _URL_CREDENTIALS.sub(_url_redacted, text) != text
            or _VALUE_QUERY.sub(_query_redacted, text) != text):
        return True
    also = list(also)
    return any(secret in text for secret in _own_secrets(tree, also)) if tree is not None or also else False


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
