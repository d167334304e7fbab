"""Generation slots between API keys (`attnlab.serve.admission`), without a model: who gets a slot, when."""
from __future__ import annotations

import asyncio

import pytest

from attnlab.serve.admission import Admission
from attnlab.serve.protocol import APIError


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_a_key_alone_on_a_one_key_server_takes_every_slot():
    async def go():
        adm = Admission(8, owners=1)
        slots = [await adm.acquire("a") for _ in range(8)]
        assert adm.busy == 8
        waiter = asyncio.ensure_future(adm.acquire("a"))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        slots[0].release()
        assert (await waiter).owner == "a"
    run(go())


def test_a_busy_key_leaves_a_slot_for_each_idle_key_and_they_start_at_once():
    async def go():
        adm = Admission(8, owners=3)
        a = [asyncio.ensure_future(adm.acquire("a")) for _ in range(8)]
        await asyncio.sleep(0.01)
        assert sum(f.done() for f in a) == 6  # two slots kept free: one for b, one for c
        b = await asyncio.wait_for(adm.acquire("b"), 0.1)
        c = await asyncio.wait_for(adm.acquire("c"), 0.1)
        assert adm.busy == 8 and {b.owner, c.owner} == {"b", "c"}
        # a's two waiting requests and a second one of b: freed slots go round robin, b first (below its share)
        b2 = asyncio.ensure_future(adm.acquire("b"))
        await asyncio.sleep(0.01)
        next(f for f in a if f.done()).result().release()
        await asyncio.sleep(0.01)
        assert b2.done() and sum(f.done() for f in a) == 6
        b.release()
        await asyncio.sleep(0.01)
        assert sum(f.done() for f in a) == 7
    run(go())


def test_slots_are_handed_round_robin_between_waiting_keys():
    async def go():
        adm = Admission(1, owners=2)
        held = [await adm.acquire("x")]
        order = []

        async def want(owner):
            slot = await adm.acquire(owner)
            order.append(owner)
            return slot
        waiting = [asyncio.ensure_future(want(o)) for o in ("a", "a", "a", "b", "b")]
        await asyncio.sleep(0.01)
        for _ in range(5):
            (held.pop(0) if held else next(f for f in waiting if f.done() and f.result().held).result()).release()
            await asyncio.sleep(0.01)
        assert order[:4] == ["a", "b", "a", "b"]
    run(go())


def test_per_key_caps_queue_timeout_and_429():
    async def go():
        adm = Admission(4, owners=2, key_active=1, key_queued=1, timeout=0.2)
        first = await adm.acquire("a")
        waiter = asyncio.ensure_future(adm.acquire("a"))  # a's one queued request (its cap is 1 active)
        await asyncio.sleep(0.01)
        with pytest.raises(APIError) as e:
            await adm.acquire("a")
        assert e.value.status == 429
        with pytest.raises(APIError) as e:
            await waiter
        assert e.value.status == 503 and "queue_timeout" in str(e.value.body())
        assert adm.summary()["waiting"] == 0
        first.release()
        first.release()  # idempotent
        assert adm.busy == 0
    run(go())


def test_a_waiter_that_leaves_gives_up_its_place():
    async def go():
        adm = Admission(1)
        slot = await adm.acquire("a")
        gone = asyncio.ensure_future(adm.acquire("a"))
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.sleep(0.01)
        slot.release()
        assert adm.busy == 0 and not adm.waiting
        assert (await adm.acquire("a")).held
    run(go())
