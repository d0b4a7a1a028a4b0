"""A reference reward server for jagg's ``served`` reward (protocol ``jagg-reward/1``, docs/rewards_served.md).

It scores each image by its mean brightness in [0, 1] (a stand-in for a judge model): pointwise requests get each
image's brightness; groupwise requests get, for each image, the share of the group's other images it is brighter
than (a tie counts half), as a pairwise-preference judge would rank them. The standard library and Pillow only.

    python examples/plugins/served_reward_server.py --port 8000 --token s3cret
    jagg train --profile ci --method jagg --set 'reward.weights={served: 1.0}' \\
        --set reward.options.served.url=http://127.0.0.1:8000/score --set reward.options.served.token=s3cret

``--port 0`` takes a free port; the first line printed is ``listening on http://HOST:PORT/score``. For testing a
client, ``--drop-request K`` closes the connection of the K-th scoring request without answering (once),
``--delay-s S`` waits S seconds before every answer, ``--status N`` answers every scoring request with HTTP status N,
and ``GET /stats`` answers ``{"requests": <scoring requests received>}``.
"""

from __future__ import annotations

import argparse
import base64
import hmac
import io
import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PROTOCOL = "jagg-reward/1"
MAX_BODY = 256 * 1024 * 1024  # bytes of one request: a batch of large PNGs, not a runaway client


def brightness(png_b64: str) -> float:
    """The mean of an image's RGB values, in [0, 1]."""
    from PIL import Image, ImageStat

    with Image.open(io.BytesIO(base64.b64decode(png_b64, validate=True))) as image:
        means = ImageStat.Stat(image.convert("RGB")).mean
    return sum(means) / (3 * 255.0)


def pairwise_wins(raw: list[float]) -> list[float]:
    """Each score's share of the other scores it beats, a tie counting half (0.5 for a group of one)."""
    n = len(raw)
    if n < 2:
        return [0.5] * n
    return [(sum(1.0 if a > b else 0.5 if a == b else 0.0 for b in raw) - 0.5) / (n - 1) for a in raw]


def score(body: dict) -> list[float]:
    """The scores of a ``jagg-reward/1`` request body (ValueError for a body that is not one)."""
    if body.get("protocol") != PROTOCOL:
        raise ValueError(f"protocol must be {PROTOCOL!r}")
    images, prompts = body.get("images"), body.get("prompts")
    if not isinstance(images, list) or not isinstance(prompts, list) or len(images) != len(prompts):
        raise ValueError("images and prompts must be lists of the same length")
    raw = [brightness(image) for image in images]
    return pairwise_wins(raw) if body.get("kind") == "groupwise" else raw


class Handler(BaseHTTPRequestHandler):
    server: "RewardServer"
    protocol_version = "HTTP/1.1"  # keep-alive, as a production server: a dropped connection is a real drop

    def log_message(self, format: str, *args) -> None:  # noqa: A002  (quiet: a test reads stdout for the port)
        pass

    def _answer(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up waiting (its timeout)
            self.close_connection = True

    def do_GET(self) -> None:  # noqa: N802
        if self.path.rstrip("/") == "/stats":
            self._answer(200, {"requests": self.server.requests})
        else:
            self._answer(404, {"error": "POST requests to /score"})

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= MAX_BODY:
            self._answer(413, {"error": f"a request body of 1 to {MAX_BODY} bytes is expected"})
            return
        raw = self.rfile.read(length)
        k = self.server.count()
        srv = self.server
        if srv.drop_request == k:  # the test's dropped connection: the request was read, no answer is sent
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if srv.delay_s:
            time.sleep(srv.delay_s)
        if srv.token and not hmac.compare_digest(self.headers.get("Authorization", ""), f"Bearer {srv.token}"):
            self._answer(401, {"error": "missing or wrong bearer token"})
            return
        if srv.status != 200:
            self._answer(srv.status, {"error": f"this server answers every request with {srv.status}"})
            return
        try:
            scores = score(json.loads(raw))
        except (ValueError, TypeError) as e:
            self._answer(400, {"error": f"not a {PROTOCOL} request: {e}"})
            return
        self._answer(200, {"scores": scores})


class RewardServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, token: str = "", *, drop_request: int = 0, delay_s: float = 0.0,
                 status: int = 200) -> None:
        super().__init__((host, port), Handler)
        self.token, self.drop_request, self.delay_s, self.status = token, drop_request, delay_s, status
        self.requests = 0
        self._lock = threading.Lock()

    def count(self) -> int:
        """This scoring request's number, from 1."""
        with self._lock:
            self.requests += 1
            return self.requests

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/score"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    ap.add_argument("--port", type=int, default=8000, help="port (0: a free one, printed)")
    ap.add_argument("--token", default="", help="require `Authorization: Bearer TOKEN`")
    ap.add_argument("--drop-request", type=int, default=0, help="testing: drop the K-th scoring request's connection")
    ap.add_argument("--delay-s", type=float, default=0.0, help="testing: wait this long before every answer")
    ap.add_argument("--status", type=int, default=200, help="testing: answer every scoring request with this status")
    args = ap.parse_args(argv)
    server = RewardServer(args.host, args.port, args.token, drop_request=args.drop_request, delay_s=args.delay_s,
                          status=args.status)
    print(f"listening on {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
