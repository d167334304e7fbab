"""The model thread: the one thread that touches the model and the caches.

Why one thread: caches and the session store are never locked against a step in flight. It runs
the calls queued for it (the session store's acquire/grow/release, a cache view) between
scheduler steps, in the order they came, and steps the scheduler (its plan, then the runner's one engine call)
while any request is in it.
Each step's events go to their requests' `deliver` (a thread-safe callable: the server hands
them to its event loop); a request's `end(keep)` runs on this thread as soon as it is done
(keep), failed or cancelled before its prompt was in (not keep), before its last events are
delivered, so a client that has its answer finds the conversation released.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future

from attnlab.serve.scheduler import Event, Scheduler

log = logging.getLogger("attnlab.serve")


class ModelThread:
    def __init__(self, scheduler: Scheduler, name: str = "attnlab-model"):
        self.scheduler, self.name = scheduler, name
        self.jobs: deque = deque()
        self.wake = threading.Condition()
        self.tickets: dict[int, tuple] = {}  # request id -> (deliver, end)
        self.thread: threading.Thread | None = None
        self.stopped = False

    def call(self, fn, *args) -> Future:
        """Run fn(*args) on the model thread, between steps; its result (or exception) in the Future."""
        future: Future = Future()
        with self.wake:
            if self.thread is None:  # started on first use
                self.thread = threading.Thread(target=self.run, name=self.name, daemon=True)
                self.thread.start()
            self.jobs.append((future, fn, args))
            self.wake.notify()
        return future

    def submit(self, deliver, end, **request) -> Future:
        """Scheduler.submit(**request) on the model thread; the Future holds the request's id."""
        def go() -> int:
            rid = self.scheduler.submit(**request)
            self.tickets[rid] = (deliver, end)
            return rid
        return self.call(go)

    def cancel(self, rid: int) -> Future:
        """Drop a request before the next step (nothing if it had ended); its `end` runs now."""
        def go() -> None:
            r = self.scheduler.cancel(rid)
            ticket = self.tickets.pop(rid, None)
            if ticket is not None:
                ticket[1](r is not None and r.prefilled)
        return self.call(go)

    def close(self) -> None:
        with self.wake:
            self.stopped = True
            self.wake.notify()

    def run(self) -> None:
        while True:
            with self.wake:
                while not self.jobs and self.scheduler.idle and not self.stopped:
                    self.wake.wait()
                if self.stopped:
                    return
                jobs, self.jobs = self.jobs, deque()
            for future, fn, args in jobs:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(*args))
                    except BaseException as e:
                        future.set_exception(e)
            if not self.scheduler.idle:
                try:
                    events = self.scheduler.step()
                except Exception as e:  # a bug in the scheduler: fail its requests rather than hang them
                    log.error("scheduler step failed", exc_info=e)
                    events = [Event(rid, "error", error=e) for rid in list(self.scheduler.requests)]
                    for rid in list(self.scheduler.requests):
                        self.scheduler.cancel(rid)
                self.dispatch(events)

    def dispatch(self, events: list[Event]) -> None:
        """Each request's events of this step, in order; a finished request's `end` first."""
        mine: dict[int, list[Event]] = {}
        for e in events:
            mine.setdefault(e.id, []).append(e)
        for rid, evs in mine.items():
            ticket = self.tickets.get(rid)
            if ticket is None:
                continue
            try:
                if evs[-1].kind in ("done", "error"):
                    del self.tickets[rid]
                    ticket[1](evs[-1].kind == "done")
                ticket[0](evs)
            except Exception as e:  # e.g. the event loop has closed: this request's reader is gone
                log.warning("could not hand request %d its events: %s", rid, e)
