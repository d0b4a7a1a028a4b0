"""Calls in flight: a reward's requests run on a small thread pool and are read back in their order.

The served reward keeps several HTTP requests open at once (:mod:`.served`), a groupwise reward that allows it is
called on several groups at once (:mod:`.groupwise`), and the trainer scores a rollout's parts while its policy
samples the next ones (:mod:`.weighted`). Each waits for its calls the same way: :func:`answers` gives their results
in the order the calls were made, or raises the first failure in that order, so what a caller sees does not depend on
which call finished first.

The calls run on :class:`Pool`'s daemon threads, not a ``ThreadPoolExecutor``'s: a process whose main thread ends
(an error elsewhere, Ctrl-C) while a request is being retried beside it does not wait for those retries at exit
(an executor's threads are joined at exit, for as long as their work takes).
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable, Sequence

__all__ = ["Pool", "answers", "failure", "in_order"]


class Pool:
    """Up to ``workers`` calls at once, each on a daemon thread of its own; a call cancelled (``Future.cancel``)
    before a worker slot freed up for it never runs."""

    def __init__(self, workers: int, name: str = "jagg-reward") -> None:
        self.slots, self.name = threading.BoundedSemaphore(max(1, workers)), name

    def submit(self, call: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            with self.slots:
                if not future.set_running_or_notify_cancel():  # cancelled while it waited for a slot
                    return
                try:
                    result = call(*args)
                except BaseException as e:  # noqa: BLE001  (handed to whoever waits, as an executor does)
                    future.set_exception(e)
                else:
                    future.set_result(result)

        threading.Thread(target=run, name=self.name, daemon=True).start()
        return future


def failure(futures: Sequence[concurrent.futures.Future]) -> BaseException | None:
    """The exception of the first call, in the calls' order, that has failed so far (None if none has)."""
    for f in futures:
        if f.done() and not f.cancelled() and f.exception() is not None:
            return f.exception()
    return None


def answers(futures: Sequence[concurrent.futures.Future]) -> list[Any]:
    """The results of ``futures`` in their order, once all are done; at the first failure, the calls not started are
    cancelled and the first failure in the calls' order among those that failed is raised. Each call must end in
    bounded time by itself (a served request has its deadline and a bounded number of retries): this waits for them."""
    concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
    if failure(futures) is not None:
        for f in futures:
            f.cancel()
        # The calls already running before the failed one may fail too: the first failure in the calls' order is
        # known once they end (the fifth request's failure was raised while the first's, slower, was in flight).
        first = next(i for i, f in enumerate(futures) if f.done() and not f.cancelled() and f.exception())
        concurrent.futures.wait([f for f in futures[:first] if not f.cancelled()])
        raise failure(futures)
    return [f.result() for f in futures]


def in_order(call: Callable[..., Any], items: Sequence[tuple], workers: int, pool: Pool | None = None) -> list[Any]:
    """``call(*item)`` for every item, up to ``workers`` at once (on ``pool`` if given), the results in the items'
    order (:func:`answers`); with one worker or one item, one after another in this thread, as a plain loop."""
    if workers <= 1 or len(items) <= 1:
        return [call(*item) for item in items]
    pool = pool or Pool(workers)
    return answers([pool.submit(call, *item) for item in items])
