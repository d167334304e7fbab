"""The model thread's hand-off to the event loop: a step's events for every request in one wake-up, in order, and an
SSE stream whose waiting deltas go out in one write, each still its own event."""
from __future__ import annotations

import asyncio
import threading

from attnlab.serve.replies import Inbox, Reply, Turn
from attnlab.serve.scheduler import Event


def test_a_steps_events_for_many_requests_wake_the_loop_once_and_arrive_in_order():
    async def main():
        loop = asyncio.get_running_loop()
        inboxes = [Inbox() for _ in range(8)]
        wakes = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: wakes.append(a) or real(*a)

        def step(k):  # the model thread's dispatch of one step
            for i, box in enumerate(inboxes):
                box.deliver([Event(i, "token", token=k, text=f"{i}.{k} ")])
        for k in range(3):
            t = threading.Thread(target=step, args=(k,))
            t.start()
            t.join()  # the loop is not running meanwhile: the whole step waits in the mailbox
            await asyncio.sleep(0)
        got = [[(await box.next()).token for _ in range(3)] for box in inboxes]
        return len(wakes), got
    wakes, got = asyncio.run(main())
    assert wakes == 3  # one per step, not one per request and step
    assert got == [[0, 1, 2]] * 8


class _Server:
    model_name, stats = "m", {"tokens_generated": 0}

    def __init__(self):
        from collections import Counter, defaultdict
        self.by_owner = defaultdict(Counter)


class _Held:
    id, stored, session = "s", False, None

    def nbytes(self):
        return 0


def test_deltas_already_waiting_go_out_in_one_write_each_its_own_event():
    async def main():
        reply = Reply(_Server(), _Held(), Turn(3, 3), chat=False, on_end=lambda: None)
        reply.extension = lambda: {}
        reply.inbox.put([Event(0, "token", token=1, text="a"), Event(0, "token", token=2, text=""),
                         Event(0, "token", token=3, text="b")])
        writes = []
        stream = reply.events(False)
        writes.append(await stream.__anext__())  # a and b were waiting: one write
        reply.inbox.put([Event(0, "token", token=4, text="c")])
        writes.append(await stream.__anext__())  # alone: its own write
        reply.inbox.put([Event(0, "done", text="", reason="length")])
        writes += [w async for w in stream]
        return writes
    writes = asyncio.run(main())
    assert [w.count("data: ") for w in writes[:2]] == [2, 1]
    assert '"text": "a"' in writes[0] and '"text": "b"' in writes[0] and '"text": "c"' in writes[1]
    assert writes[-1] == "data: [DONE]\n\n" and '"finish_reason": "length"' in writes[-2]
