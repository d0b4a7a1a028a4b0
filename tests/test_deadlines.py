"""Issue 61, mechanism 2: every wait has a deadline. The served reward against real HTTP servers on 127.0.0.1 that drip
their answer or answer JSON the client must not read whole (the helpers of tests/test_served_rewards.py), and a
pool-dispatched sweep that no worker serves."""

from __future__ import annotations

import http.server
import re
import time

import pytest

from test_served_rewards import _one_sentence, _score, _serving, garbage_server
from jagg_core.rewards.served import ServedRewardError


# --- the served reward: one deadline per request ---------------------------------------------------------------------

class _Drip(http.server.BaseHTTPRequestHandler):
    """Answers every POST with valid scores, one byte every ``server.every_s`` seconds: of its status line and headers
    (``server.part == "head"``) or of its body (``"body"``). No single read waits long; the whole answer does."""

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.requests += 1
        body = b'{"scores": [1, 2, 3, 4, 5, 6]}' + b" " * 70
        head = f"HTTP/1.0 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        drip, at_once = (head + body, b"") if self.server.part == "head" else (body, head)
        try:
            self.wfile.write(at_once)
            self.wfile.flush()
            for i in range(len(drip)):
                self.wfile.write(drip[i:i + 1])
                self.wfile.flush()
                time.sleep(self.server.every_s)
        except OSError:  # the client cut the connection: its deadline
            pass


def drip_server(part: str, every_s: float = 0.05):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Drip)
    server.part, server.every_s, server.requests, server.daemon_threads = part, every_s, 0, True
    return _serving(server)


@pytest.mark.parametrize("part", ["head", "body"])
def test_a_server_that_drips_its_answer_is_cut_at_the_deadline_retried_then_one_sentence(part):
    """A byte every 0.05 s never lets one read wait 0.3 s: before, the answer's ~100 bytes took 5 s and were accepted
    (each read within timeout_s); now each request has one deadline of timeout_s, all of it."""
    with drip_server(part) as srv:
        url = f"http://127.0.0.1:{srv.server_address[1]}/score"
        start = time.monotonic()
        with pytest.raises(ServedRewardError) as e:
            _score(url, timeout_s=0.3, retries=1)
        took = time.monotonic() - start
        assert srv.requests == 2  # the first attempt and one retry, as for any timeout
    text = str(e.value)
    _one_sentence(text)
    assert f"the reward server at {url} did not answer within 0.3 s (2 attempts); if the judge is slow" in text, text
    assert took < 2.0, took


def test_a_server_that_answers_in_time_a_byte_at_a_time_still_gives_its_scores():
    """The deadline is on the whole answer, not a guess: a drip that ends within it is read whole."""
    with drip_server("body", every_s=0.002) as srv:
        scores = _score(f"http://127.0.0.1:{srv.server_address[1]}/score", timeout_s=5)
    assert scores.tolist() == [1, 2, 3, 4, 5, 6]


# --- the served reward: an answer parsed with bounds, and what is wrong said -----------------------------------------

DEEP = b"[" * 200_000 + b"]" * 200_000


@pytest.mark.parametrize("body, says", [
    (b'{"scores": ' + DEEP + b"}", "answered JSON nested deeper than 64 levels; it must answer"),
    (b'{"scores": [1, 2, 3, 4, 5, 6], "scores": [6, 5, 4, 3, 2, 1]}',
     "answered JSON whose key 'scores' is given twice in one object; it must answer"),
    (b'{"scores": [1, 2, 3, 4, 5, 1' + b"0" * 4999 + b"]}", "answered a number of 5,000 digits; it must answer"),
    (b'{"scores": [1, 2, 3, 4, 5, 6.' + b"0" * 4999 + b"]}", "answered a number of 5,000 digits; it must answer"),
], ids=["200000-nested", "key-twice", "5000-digit-int", "5000-digit-float"])
def test_an_answer_too_deep_with_a_key_twice_or_a_huge_number_is_one_sentence_saying_so(body, says):
    """Before: 200,000 nested [ was a RecursionError traceback, a key twice was read (the last one won), a
    5,000-digit integer was "not JSON" (Python's int limit), a 5,000-digit float was read."""
    with garbage_server(body) as srv:
        url = f"http://127.0.0.1:{srv.server_address[1]}/score"
        with pytest.raises(ServedRewardError) as e:
            _score(url, retries=3)
    _one_sentence(str(e.value))
    assert f"the reward server at {url} {says}" in str(e.value), str(e.value)


def test_a_refusal_whose_error_body_is_nested_200000_deep_is_still_the_refusals_sentence():
    """Before: the 4xx's body, read for its "error", was a RecursionError traceback."""
    with garbage_server(b'{"error": ' + DEEP + b"}", status=422) as srv:
        with pytest.raises(ServedRewardError) as e:
            _score(f"http://127.0.0.1:{srv.server_address[1]}/score", retries=3)
    _one_sentence(str(e.value))
    assert "refused the request with HTTP 422; a refused request is not retried" in str(e.value), str(e.value)


def test_a_plain_answer_is_read_as_before():
    with garbage_server(b'{"scores": [1, 2.5, -3e2, 4, 5, 6], "note": {"a": [{"b": "[[[{{{"}]}}') as srv:
        scores = _score(f"http://127.0.0.1:{srv.server_address[1]}/score")
    assert scores.tolist() == [1, 2.5, -300, 4, 5, 6]
