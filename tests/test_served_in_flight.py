"""Several requests in flight, and scoring beside sampling, against real HTTP servers on 127.0.0.1: the reference
server of ``examples/plugins/served_reward_server.py`` held until several requests have arrived (a barrier), its
answers sent in the reverse order; the scores must land in batch order, the same bits as one request at a time."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from jagg_core.rewards import make_reward, make_weighted_reward
from jagg_core.rewards.served import ServedRewardError
from test_served_rewards import SERVER, _images, _serving, reference_server


class _HeldHandler(SERVER.Handler):
    """The reference server's handler that holds each scoring request until ``server.hold`` requests have arrived
    (a barrier), then answers the last to arrive first."""

    def do_POST(self) -> None:  # noqa: N802
        srv = self.server
        with srv.lock:
            srv.open += 1
            srv.peak = max(srv.peak, srv.open)
            arrival = srv.arrived
            srv.arrived += 1
        try:
            srv.barrier.wait()
        except threading.BrokenBarrierError:  # fewer requests than held came: one at a time
            self._answer(500, {"error": "held alone: the requests came one at a time"})
            return
        finally:
            with srv.lock:
                srv.open -= 1
        time.sleep(0.05 * (srv.hold - 1 - arrival % srv.hold))  # the first to arrive answers last
        super().do_POST()


class HeldServer(SERVER.RewardServer):
    def __init__(self, hold: int) -> None:
        super().__init__("127.0.0.1", 0)
        self.RequestHandlerClass = _HeldHandler
        self.hold, self.lock = hold, threading.Lock()
        self.open = self.peak = self.arrived = 0
        self.barrier = threading.Barrier(hold, timeout=3)


def _brightness(images: torch.Tensor) -> torch.Tensor:
    return ((images * 255).round() / 255).mean((1, 2, 3))


def test_several_requests_are_in_flight_at_once_and_the_scores_land_in_batch_order():
    images, prompts = _images(8), [f"prompt {i // 2}" for i in range(8)]
    with reference_server() as srv:  # one at a time: the scores as before requests were in flight
        one_by_one, _ = make_reward("served", url=srv.url, batch_size=2, max_in_flight=1)(images, prompts, [{}] * 8)
    with _serving(HeldServer(hold=4)) as srv:  # the 4 requests answer only once all 4 are open
        scores, _ = make_reward("served", url=srv.url, batch_size=2, max_in_flight=4)(images, prompts, [{}] * 8)
        assert (srv.requests, srv.peak) == (4, 4)
    assert torch.equal(scores, one_by_one)
    assert torch.allclose(scores, _brightness(images), atol=1e-6)


def test_a_groupwise_served_reward_asks_for_its_groups_at_once_in_batch_order():
    groups = torch.tensor([7, 7, 3, 3, 5, 5])
    images = _images(6).flip(0)  # each group's first image is the brighter
    with _serving(HeldServer(hold=3)) as srv:
        fn = make_weighted_reward({"served": 1.0}, {"served": {"url": srv.url, "kind": "groupwise",
                                                               "max_in_flight": 3, "overlap": False}})
        total, _ = fn(images, ["a", "a", "b", "b", "c", "c"], [{}] * 6, groups=groups)
        assert (srv.requests, srv.peak) == (3, 3)
    assert total.tolist() == [1.0, 0.0] * 3


def test_a_request_that_fails_among_several_in_flight_is_the_same_one_sentence():
    with reference_server(status=422) as srv:
        with pytest.raises(ServedRewardError) as e:
            make_reward("served", url=srv.url, batch_size=2, max_in_flight=4)(_images(8), ["p"] * 8, [{}] * 8)
    text = str(e.value)
    assert "\n" not in text and text.endswith(".") and "refused the request with HTTP 422" in text, text


class _FailingHandler(SERVER.Handler):
    """Refuses the request whose first prompt is "first" after 0.5 s and the one whose first prompt is "fifth" at
    once; scores the others."""

    def do_POST(self) -> None:  # noqa: N802
        import json

        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        which = body["prompts"][0]
        if which in ("first", "fifth"):
            time.sleep(0.5 if which == "first" else 0.0)
            self._answer(422, {"error": f"the {which} request is refused"})
        else:
            self._answer(200, {"scores": [0.5] * len(body["prompts"])})


def test_the_first_failure_in_batch_order_is_the_sentence_whichever_fails_first():
    """docs/rewards_served.md: "The first failure in batch order is the one sentence". The fifth request failing at
    once while the first, slower, was still in flight raised the fifth's; now the first's."""
    server = SERVER.RewardServer("127.0.0.1", 0)
    server.RequestHandlerClass = _FailingHandler
    prompts = [p for p in ("first", "b", "c", "d", "fifth", "f") for _ in range(2)]
    with _serving(server) as srv:
        with pytest.raises(ServedRewardError) as e:
            make_reward("served", url=f"http://127.0.0.1:{srv.server_address[1]}/score", batch_size=2,
                        max_in_flight=6, retries=0)(_images(12), prompts, [{}] * 12)
    assert "the first request is refused" in str(e.value), str(e.value)


def test_a_rollouts_parts_are_scored_while_it_samples_the_same_bits_as_after_it():
    """Each part's requests are sent as soon as the part is added (the server has them before the next part comes),
    and the total equals scoring the whole batch after sampling, bit for bit."""
    images = torch.nn.functional.interpolate(_images(8), size=16)  # the toy reward beside it wants 12 pixels or more
    groups = torch.tensor([0] * 4 + [1] * 4)
    prompts = ["a red circle"] * 4 + ["a blue square"] * 4
    options = {"url": "", "batch_size": 2, "backoff_s": 0.0}
    with reference_server() as srv:
        options["url"] = srv.url
        whole, whole_info = make_weighted_reward({"served": 1.0, "toy_background": 0.5},
                                                 {"served": {**options, "overlap": False}})(
            images, prompts, [{}] * 8, groups=groups)
        fn = make_weighted_reward({"served": 1.0, "toy_background": 0.5}, {"served": options})
        assert fn.beside
        scoring = fn.begin(prompts, [{}] * 8, groups)
        before = srv.requests
        scoring.add(images[:4])
        deadline = time.monotonic() + 5
        while srv.requests < before + 2 and time.monotonic() < deadline:  # the first part's 2 requests, in flight
            time.sleep(0.01)
        assert srv.requests == before + 2
        scoring.add(images[4:])
        total, info = scoring.result()
        assert srv.requests == before + 4
    assert torch.equal(total, whole)
    assert info.keys() == whole_info.keys() and all(torch.equal(info[k], whole_info[k]) for k in info)


def test_a_judge_that_fails_beside_sampling_stops_it_with_the_same_one_sentence():
    with reference_server(status=422) as srv:
        fn = make_weighted_reward({"served": 1.0}, {"served": {"url": srv.url, "batch_size": 2}})
        scoring = fn.begin(["p"] * 8, [{}] * 8, torch.zeros(8))
        with pytest.raises(ServedRewardError, match="refused the request with HTTP 422") as e:
            # the first part's requests go out now: their answer may already be back when this add checks (a fast
            # server), else a later add or the result says it
            scoring.add(_images(8)[:4])
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # the next part's add, or the result, says it
                scoring.add(_images(8)[4:5]) if scoring.sampled < 8 else scoring.result()
                time.sleep(0.05)
    assert "\n" not in str(e.value)


def test_a_process_that_ends_while_a_request_beside_it_is_retried_does_not_wait_for_its_retries():
    """The main thread stops (an error elsewhere, Ctrl-C) while the judge is unreachable and a request sent beside
    sampling waits to be retried: the process ends at once, not after the retries' backoff (5 + 10 + 20 s here)."""
    import subprocess
    import sys

    from conftest import REPO
    from test_served_rewards import _free_port

    script = (f"import torch\nfrom jagg_core.rewards import make_weighted_reward\n"
              f"fn = make_weighted_reward({{'served': 1.0}}, {{'served': {{'url': 'http://127.0.0.1:{_free_port()}/s', "
              f"'retries': 3, 'backoff_s': 5.0, 'batch_size': 2}}}})\n"
              f"scoring = fn.begin(['p'] * 4, [{{}}] * 4, torch.zeros(4))\n"
              f"scoring.add(torch.rand(2, 3, 8, 8))\nimport time; time.sleep(0.5)\nraise SystemExit(3)\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stderr[-2000:]
    assert time.monotonic() - t0 < 15, "the process waited for the retries of a request nobody waits for"
