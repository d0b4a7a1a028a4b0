"""The ``served`` reward: scores computed by another process over HTTP (a judge model on its own GPU box).

The protocol (``jagg-reward/1``; docs/rewards_served.md, ``examples/plugins/served_reward_server.py`` is a reference
server):

Request: ``POST <url>`` with ``Content-Type: application/json``, ``Authorization: Bearer <token>`` when a token is
set, and the body::

    {"protocol": "jagg-reward/1",
     "kind": "pointwise" | "groupwise",
     "images": ["<base64 PNG>", ...],      # RGB, 8 bits per channel, the images as the policy made them
     "prompts": ["<prompt>", ...],         # one per image
     "metadata": [{...}, ...]}             # one JSON object per image (may be empty)

A pointwise request holds up to ``batch_size`` images, any prompts; a groupwise request holds exactly the images of one
prompt's group, whatever ``batch_size`` says (the server ranks them against each other).

Response: status 200 and a JSON object ``{"scores": [s_0, s_1, ...]}`` with one finite number per image of the
request, in its order (other keys are ignored). A refusal is any 4xx status, with ``{"error": "<sentence>"}`` as body
if the server wants it shown.

What the client does with an answer:

- a dropped or reset connection, a connect failure or no whole answer within ``timeout_s`` (one deadline per request:
  connecting, sending and reading every byte of the answer; a server that drips its answer is cut off at it), and
  HTTP 502, 503 or 504 (a proxy or a judge that is restarting: the request never reached a working scorer) are
  retried, up to ``retries`` times with exponential backoff from ``backoff_s`` (capped at 30 s): the same request
  again, so the scores are those of an undisturbed call;
- a 4xx is never retried (the same request would be refused again): one sentence with the server's ``error``;
- any other 5xx, any other status, a body that is not JSON (or JSON nested deeper than 64 levels, an object that
  gives a key twice, a number of more than 1,000 digits: each said as such), a wrong number of scores or a score that
  is not a finite number: one sentence, no retry (the server is broken, not unreachable).

Up to ``max_in_flight`` requests are open at once (a pointwise batch's requests, or a trainer's groups scored beside
its sampling, :mod:`.weighted`); each is retried on its own, and the scores are put back in batch order, so they are
those of requests sent one after another.

Every sentence names the server by its address with its query removed; the token is never shown (it is remembered
for redaction, :mod:`jagg_core.setup.redact`). A ``url`` with credentials (``user:password@``) is refused: they would
be sent as HTTP Basic, not as the protocol's Bearer token.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import random
import re
import threading
import time
from typing import TYPE_CHECKING, Annotated, Any, Callable, Literal, Mapping, NamedTuple, Sequence
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field

from ..setup.redact import redact, remember
from .base import REWARD_KINDS, RewardError, RewardFn, register_reward
from .inflight import Pool, in_order

if TYPE_CHECKING:
    import torch

__all__ = ["PROTOCOL", "ServedRewardError", "encode_png", "served", "shown_address"]

log = logging.getLogger(__name__)

PROTOCOL = "jagg-reward/1"
_RETRIED_STATUS = (502, 503, 504)  # a proxy or a restarting judge: the request reached no working scorer
_MAX_BACKOFF_S = 30.0
_SHOWN_ERROR = 200  # characters of a server's own error text quoted in a sentence
MAX_ANSWER = 64 * 2**20  # bytes of an answer read at most: scores of any batch fit many times over
MAX_DEPTH = 64  # levels of [ and { in an answer: {"scores": [...]} needs 2
MAX_DIGITS = 1000  # digits of one number in an answer: a float has at most 17 that count, 309 before its point
MAX_IN_FLIGHT = 64  # requests open at once, at most: a judge box is a few GPUs, not a server farm


class _Answer(NamedTuple):
    status: int
    body: bytes


class ServedRewardError(RewardError):
    """The reward server cannot be used: down, refusing, or answering garbage. The message is one sentence."""


def shown_address(url: str) -> str:
    """``url`` as a sentence may show it: scheme, host, port and path, without credentials or a query."""
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unclosed IPv6 bracket
        return "(an address that cannot be read)"
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    try:
        port = parts.port
    except ValueError:  # a port that is not a number: shown as typed, after the host
        port = parts.netloc.rpartition("@")[2].rpartition(":")[2]
    netloc = f"{host}:{port}" if port else host
    return redact(urlunsplit((parts.scheme, netloc, parts.path, "", "")))


def encode_png(images: torch.Tensor) -> list[str]:
    """(B, 3, H, W) in [0, 1] → B base64 PNGs (8-bit RGB, rounded as every saved image of the project)."""
    import torch
    from PIL import Image

    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be (B, 3, H, W), got shape {tuple(images.shape)}.")
    arrays = (images.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    out = []
    for array in arrays:
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="PNG")
        out.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    return out


# reward.options.served: where its server is, its secret, and how long and how often to ask it
OPTIONS = {"url": (Annotated[str, Field(pattern=r"^https?://\S+$", max_length=2048)], None),
           "token": (Annotated[str, Field(max_length=4096)], None),
           "timeout_s": (Annotated[float, Field(gt=0, le=3600)], None),
           "batch_size": (Annotated[int, Field(ge=1, le=4096)], None),
           "retries": (Annotated[int, Field(ge=0, le=20)], None),
           "backoff_s": (Annotated[float, Field(ge=0, le=60)], None),
           "max_in_flight": (Annotated[int, Field(ge=1, le=MAX_IN_FLIGHT)], None),
           "overlap": (bool, None),
           "kind": (Literal["pointwise", "groupwise"], None)}


@register_reward("served", kind=lambda options: options.get("kind", "pointwise"), options=OPTIONS,
                 beside_policy=lambda options: options.get("overlap", True), reusable=False,
                 transport=("token", "timeout_s", "batch_size", "retries", "backoff_s", "max_in_flight", "overlap"),
                 describe=lambda options: f"the reward server at {shown_address(options.get('url', ''))}; its own "
                                          f"scores, as it answers them")
def served(url: str = "", token: str = "", timeout_s: float = 60.0, batch_size: int = 16, retries: int = 3,
           backoff_s: float = 0.5, max_in_flight: int = 8, overlap: bool = True, kind: str = "pointwise") -> RewardFn:
    """A reward computed by the server at ``url`` (the protocol: this module's docstring, docs/rewards_served.md).

    Args:
        url: the scoring endpoint, ``http://`` or ``https://``, without credentials (``user:password@`` would be sent
            as HTTP Basic: refused; the secret belongs in ``token``).
        token: sent as ``Authorization: Bearer <token>``; a secret (redacted from params, logs and errors).
        timeout_s: seconds one request may take, all of it: connecting, sending and reading the whole answer.
        batch_size: images per request of a pointwise reward (a groupwise request is one whole group).
        retries: times a request is sent again after a transport failure (and 502/503/504).
        backoff_s: the first wait before a retry, doubled each time (at most 30 s).
        max_in_flight: requests open at once, at most (docs/rewards_served.md measures the default).
        overlap: the trainer sends a rollout's requests as soon as their images are sampled, while the policy samples
            the next ones (the spec's ``beside_policy``; the same requests, the same scores).
        kind: ``pointwise`` (a score per image) or ``groupwise`` (the server sees one prompt's group at once).
    """
    import torch

    if not url:
        raise ServedRewardError("reward.options.served.url is needed: the address of the reward server, e.g. "
                                "http://judge-box:8000/score (docs/rewards_served.md).")
    if not _http_address(url):
        raise ServedRewardError(f"reward.options.served.url must be an http:// or https:// address, got "
                                f"{shown_address(url)!r}.")
    if "@" in urlsplit(url).netloc:  # httpx would send them as HTTP Basic, beside or instead of the Bearer token
        raise ServedRewardError(f"reward.options.served.url {shown_address(url)!r} holds credentials before its host, "
                                f"which would be sent as HTTP Basic: put the secret in reward.options.served.token "
                                f"(sent as a Bearer token) and the address alone in url.")
    if kind not in REWARD_KINDS:
        raise ServedRewardError(f"reward.options.served.kind must be one of {', '.join(REWARD_KINDS)}, got {kind!r}.")
    if not (timeout_s > 0 and batch_size >= 1 and retries >= 0 and backoff_s >= 0
            and isinstance(max_in_flight, int) and 1 <= max_in_flight <= MAX_IN_FLIGHT):
        raise ServedRewardError(f"reward.options.served needs timeout_s > 0, batch_size >= 1, retries >= 0, "
                                f"backoff_s >= 0 and max_in_flight from 1 to {MAX_IN_FLIGHT}.")
    if token and not (token.isascii() and token.isprintable() and " " not in token):
        raise ServedRewardError("reward.options.served.token must be printable ASCII without spaces (it is sent as "
                                "an HTTP header).")
    if token:
        remember({"token": token})  # redacted wherever this process quotes it later (a log line, a library's error)
    client = _Client(url, token, timeout_s, retries, backoff_s, max_in_flight)
    step = batch_size if kind == "pointwise" else None

    def fn(
        images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        n = len(prompts)
        chunks = [(0, n)] if step is None else [(i, min(i + step, n)) for i in range(0, n, step)]

        def ask(a: int, b: int) -> list[float]:
            return client.score({"protocol": PROTOCOL, "kind": kind, "images": encode_png(images[a:b]),
                                 "prompts": list(prompts[a:b]), "metadata": [dict(m) for m in metadata[a:b]]})

        scores = client.in_order(ask, chunks)
        return torch.tensor([s for part in scores for s in part], dtype=torch.float32), {}

    # how the trainer may call it beside its sampling (rewards/weighted.py): requests of `request_size` images from the
    # batch's start (None: one call per group), up to `max_in_flight` at once
    fn.request_size, fn.max_in_flight = step, max_in_flight
    return fn


class _Client:
    """One server's HTTP client: a request with bounded retries for transport failures, and the answer's checks."""

    def __init__(self, url: str, token: str, timeout_s: float, retries: int, backoff_s: float,
                 max_in_flight: int = 1) -> None:
        import httpx

        self.url, self.where = url, shown_address(url)
        self.retries, self.backoff_s, self.timeout_s = retries, backoff_s, timeout_s
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        # No kept-alive connection: each request connects anew, so its deadline knows the socket to cut (a local
        # connect costs well under a millisecond; a judge scores a batch in hundreds).
        self.http = httpx.Client(timeout=httpx.Timeout(timeout_s), headers=headers, follow_redirects=False,
                                 limits=httpx.Limits(max_keepalive_connections=0),
                                 trust_env=False)  # no proxy from the environment between the trainer and its judge
        self.jitter = random.Random()  # private: the training's own random streams stay untouched
        self.max_in_flight = max_in_flight
        self.slots = threading.BoundedSemaphore(max_in_flight)  # requests open at once, whichever thread sends them
        self.pool = Pool(max_in_flight, "jagg-served")

    def in_order(self, ask: Callable[[int, int], list[float]], chunks: list[tuple[int, int]]) -> list[list[float]]:
        """``ask(a, b)`` for every chunk, up to ``max_in_flight`` at once, the answers in the chunks' order (the first
        failure in that order is raised; the requests not yet sent are not sent)."""
        return in_order(ask, chunks, self.max_in_flight, self.pool)

    def score(self, body: dict[str, Any]) -> list[float]:
        """The scores the server gives the request ``body`` (one per image), or one sentence."""
        content = json.dumps(body, default=str).encode()
        attempts = self.retries + 1
        for attempt in range(attempts):
            failure = self._post(content)
            if isinstance(failure, _Answer):
                return self._scores(failure, len(body["images"]))
            if attempt + 1 < attempts:
                wait = min(self.backoff_s * 2**attempt, _MAX_BACKOFF_S) * (1 + 0.25 * self.jitter.random())
                what, reason, _ = failure  # each retry leaves one line: which attempt failed, and why
                log.warning("the reward server at %s %s (attempt %d of %d%s); retrying in %.1f s", self.where,
                            redact(what), attempt + 1, attempts, f": {redact(reason)}" if reason else "", wait)
                time.sleep(wait)
        what, reason, hint = failure
        tried = f"{attempts} attempt{'s' if attempts > 1 else ''}{f': {reason}' if reason else ''}"
        raise ServedRewardError(f"the reward server at {self.where} {what} ({tried}); {hint}.")

    def _post(self, content: bytes):  # noqa: ANN202  (the answer, or (what failed, why, what to do) to retry)
        import httpx

        deadline = _Deadline(self.timeout_s)
        try:
            with self.slots, deadline, self.http.stream("POST", self.url, content=content,
                                            extensions={"trace": deadline.trace}) as response:
                answer = _Answer(response.status_code, _bounded_body(response, self.where))
        except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as e:
            if deadline.expired or isinstance(e, httpx.TimeoutException):  # cut at its deadline, or one step timed out
                return (f"did not answer within {self.timeout_s:g} s", "",
                        "if the judge is slow, raise reward.options.served.timeout_s")
            if isinstance(e, httpx.ConnectError):
                return ("cannot be reached", _reason(e), "check that it runs and that reward.options.served.url is "
                        "its address")
            return "dropped the connection", _reason(e), "check the server's log"
        except httpx.HTTPError as e:  # a request this client cannot make at all (a bad address): not retried
            raise ServedRewardError(f"the reward server at {self.where} cannot be asked: {_reason(e)}.") from None
        if answer.status in _RETRIED_STATUS:
            return f"answered HTTP {answer.status}{_said(answer.body)}", "", "check the server's log"
        return answer

    def _scores(self, answer: _Answer, n: int) -> list[float]:
        status = answer.status
        if 400 <= status < 500:
            hint = " (check reward.options.served.token)" if status in (401, 403) else ""
            raise ServedRewardError(f"the reward server at {self.where} refused the request with HTTP {status}"
                                    f"{_said(answer.body)}{hint}; a refused request is not retried.")
        if status != 200:
            raise ServedRewardError(f"the reward server at {self.where} answered HTTP {status}{_said(answer.body)} "
                                    f"instead of scores.")
        try:
            parsed = _parse(answer.body)
        except _Unreadable as e:
            raise ServedRewardError(f"the reward server at {self.where} answered {e}; it must answer "
                                    f"{{\"scores\": [...]}} (docs/rewards_served.md).") from None
        except (ValueError, UnicodeDecodeError):
            raise ServedRewardError(f"the reward server at {self.where} answered something that is not JSON "
                                    f"({_start(answer.body.decode('utf-8', 'replace'))!r}); it must answer "
                                    f"{{\"scores\": [...]}} (docs/rewards_served.md).") from None
        scores = parsed.get("scores") if isinstance(parsed, dict) else None
        if not isinstance(scores, list) or len(scores) != n:
            got = f"{len(scores)} scores" if isinstance(scores, list) else "no list under \"scores\""
            raise ServedRewardError(f"the reward server at {self.where} answered {got} for {n} images; it must "
                                    f"answer {{\"scores\": [...]}} with one number per image (docs/rewards_served.md).")
        bad = [s for s in scores if not _finite(s)]
        if bad:
            raise ServedRewardError(f"the reward server at {self.where} answered a score that is not a finite "
                                    f"number ({_start(json.dumps(bad[0]))}); every score must be one.")
        return [float(s) for s in scores]


def _http_address(url: str) -> bool:
    try:
        parts = urlsplit(url)
        return parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port or 0) >= 0
    except ValueError:
        return False


def _reason(e: BaseException) -> str:
    """An exception's text for a sentence: one line, short, redacted."""
    text = " ".join(str(e).split()).rstrip(".") or type(e).__name__
    return redact(text[:_SHOWN_ERROR])


def _start(text: str) -> str:
    text = " ".join(text.split())
    return redact(text[:60] + ("…" if len(text) > 60 else ""))


def _said(body: bytes) -> str:
    """`` ("<the server's error>")`` when ``body`` is ``{"error": "..."}``, else nothing."""
    try:
        error = _parse(body).get("error")
    except (ValueError, UnicodeDecodeError, AttributeError):  # _Unreadable is a ValueError
        return ""
    return f" ({redact(' '.join(str(error).split())[:_SHOWN_ERROR])})" if error else ""


def _finite(score: Any) -> bool:
    """A JSON number that is a finite float (not a bool, not NaN or ±Infinity, not an integer beyond floats)."""
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        return False
    try:
        return math.isfinite(float(score))
    except OverflowError:
        return False


def _bounded_body(response, where: str) -> bytes:  # noqa: ANN001  (an httpx streamed response)
    """The answer's body, at most :data:`MAX_ANSWER` bytes (a runaway server is one sentence, not the memory)."""
    body = bytearray()
    for chunk in response.iter_bytes():
        body += chunk
        if len(body) > MAX_ANSWER:
            raise ServedRewardError(f"the reward server at {where} answered more than {MAX_ANSWER // 2**20} MiB; "
                                    f"an answer is a list of scores.")
    return bytes(body)


class _Deadline:
    """One request's deadline: a context that, once ``seconds`` have passed, shuts the request's socket (found
    through httpcore's ``trace`` extension as it connects), so that a read or a write blocked on it returns at once.
    A server that drips its answer a byte at a time never lets one read time out; this bounds all of them."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.expired = seconds, False
        self.sockets: list[Any] = []
        self.lock = threading.Lock()
        self.timer = threading.Timer(seconds, self._expire)
        self.timer.daemon = True

    def __enter__(self) -> _Deadline:
        self.timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.timer.cancel()

    def trace(self, event: str, info: Mapping[str, Any]) -> None:
        """httpcore's trace hook: keep the socket of each connection this request opens (TCP, then TLS)."""
        if event in ("connection.connect_tcp.complete", "connection.start_tls.complete"):
            stream = info.get("return_value")
            sock = stream.get_extra_info("socket") if stream is not None else None
            if sock is not None:
                with self.lock:
                    self.sockets.append(sock)
                    if self.expired:
                        _shut(sock)

    def _expire(self) -> None:
        with self.lock:
            self.expired = True
            for sock in self.sockets:
                _shut(sock)


def _shut(sock: Any) -> None:
    import socket

    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed already: the request ended as the deadline came
        pass


class _Unreadable(ValueError):
    """An answer that is JSON the client will not read; its text is what is wrong, for a sentence."""


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")


def _parse(body: bytes) -> Any:
    """``body`` as JSON, bounded: nested at most :data:`MAX_DEPTH` levels, no key twice in an object, no number of
    more than :data:`MAX_DIGITS` digits (each an :class:`_Unreadable` saying so); ValueError if it is not JSON."""
    brackets = _NOT_BRACKET.sub(b"", _STRING.sub(b"", body))  # [ ] { } outside strings, in order
    depth = 0
    for b in brackets:
        depth += 1 if b in b"[{" else -1
        if depth > MAX_DEPTH:
            raise _Unreadable(f"JSON nested deeper than {MAX_DEPTH} levels")
    return json.loads(body, object_pairs_hook=_no_key_twice, parse_int=_number(int), parse_float=_number(float))


def _no_key_twice(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Unreadable(f"JSON whose key {_start(key)!r} is given twice in one object")
        out[key] = value
    return out


def _number(kind: type) -> Any:
    def parse(text: str) -> Any:
        digits = sum(c.isdigit() for c in text)
        if digits > MAX_DIGITS:
            raise _Unreadable(f"a number of {digits:,} digits")
        return kind(text)

    return parse
