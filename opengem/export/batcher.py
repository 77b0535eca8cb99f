"""Micro-batching: one worker thread owns the model; concurrent requests share one forward.

The worker takes the oldest queued request, then every request already queued behind it; while
the server is still parsing other requests (``incoming`` > 0, so they will arrive within the
parse time), it waits for them up to ``window_s``, stopping once ``max_candidates`` are
collected. A lone request therefore never waits, and a burst is scored together.

Hot reload: ``swap(new)`` replaces the predictor reference. The worker reads that reference once
per micro-batch, so a micro-batch in flight finishes on the model it started with and the next
one uses the new model; no request is dropped or scored by a half-loaded model.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable

from opengem.export.request import ParsedRequest

log = logging.getLogger("opengem.export")
_STOP = object()


class MicroBatcher:
    """Args: predictor (``Predictor``), window_s (longest wait for more requests), max_candidates
    (soft cap on candidates per forward), on_batch (callback(requests, candidates, seconds))."""

    def __init__(self, predictor, window_s: float = 0.002, max_candidates: int = 2048,
                 on_batch: Callable[[int, int, float], None] | None = None):
        self._predictor = predictor
        self.window_s, self.max_candidates, self.on_batch = window_s, max_candidates, on_batch
        # requests being parsed by the event loop (only the loop thread writes it)
        self.incoming = 0
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="opengem-scorer", daemon=True)

    @property
    def predictor(self):
        return self._predictor

    def swap(self, new):
        """Use ``new`` from the next micro-batch on; returns the previous predictor."""
        old, self._predictor = self._predictor, new
        return old

    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> MicroBatcher:
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Score everything already queued, then end the worker."""
        if self._thread.is_alive():
            self._q.put(_STOP)
            self._thread.join(timeout)

    def submit(self, parsed: ParsedRequest) -> asyncio.Future:
        """Queue a request (from the event loop); await the returned future for its response."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._q.put((parsed, fut, loop))
        return fut

    # ------------------------------------------------------------------ worker
    def _collect(self, first) -> tuple[list, bool]:
        batch, n, stop = [first], first[0].num_candidates, False
        deadline = time.perf_counter() + self.window_s
        while n < self.max_candidates:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                remaining = deadline - time.perf_counter()
                if self.incoming <= 0 or remaining <= 0:
                    break
                try:
                    item = self._q.get(timeout=remaining)
                except queue.Empty:
                    break
            if item is _STOP:
                stop = True
                break
            batch.append(item)
            n += item[0].num_candidates
        return batch, stop

    def _run(self) -> None:
        stop = False
        while not stop:
            first = self._q.get()
            if first is _STOP:
                break
            batch, stop = self._collect(first)
            predictor = self._predictor  # one model for the whole micro-batch
            t0 = time.perf_counter()
            results = self._score(predictor, [b[0] for b in batch])
            if self.on_batch is not None:
                self.on_batch(len(batch), sum(b[0].num_candidates for b in batch),
                              time.perf_counter() - t0)
            for (_, fut, loop), res in zip(batch, results):
                loop.call_soon_threadsafe(_resolve, fut, res)

    @staticmethod
    def _score(predictor, reqs: list[ParsedRequest]) -> list:
        try:
            return predictor.score(reqs)
        except Exception as e:  # one bad request must not fail its neighbours
            if len(reqs) == 1:
                log.exception("scoring failed")
                return [e]
            return [MicroBatcher._score(predictor, [r])[0] for r in reqs]


def _resolve(fut: asyncio.Future, res) -> None:
    if fut.cancelled():
        return
    if isinstance(res, BaseException):
        fut.set_exception(res)
    else:
        fut.set_result(res)
