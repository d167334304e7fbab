"""The session store: prefix matching, busy sessions never shared, LRU eviction by count and by bytes."""
from __future__ import annotations

import pytest

from attnlab.options import PolicySpec
from attnlab.serve.sessions import SessionStore

SINK = PolicySpec("sink", 8, 4, "cache")


def test_longest_idle_prefix_wins_and_busy_sessions_are_not_shared(tiny):
    store = SessionStore(tiny, max_sessions=8, chunk=4)
    a, reused = store.acquire("<a>", SINK)
    assert not reused
    a.session.text = "<a>"
    store.release(a)
    b, reused = store.acquire("<z>", SINK)
    assert not reused and b is not a
    b.session.text = "<a><b>"  # as if it had held the conversation <a> and then <b>
    store.release(b)
    got, reused = store.acquire("<a><b><c>", SINK)
    assert reused and got is b                       # longest prefix
    other, reused = store.acquire("<a><b><c>", SINK)
    assert other is a and reused                     # b is busy: the next best idle one
    third, reused = store.acquire("<a><b><c>", SINK)
    assert not reused                                # everything matching is busy: a fresh cache
    assert store.acquire("<a>", PolicySpec("window", 8))[1] is False  # another policy never matches


def test_lru_eviction_by_count_and_bytes(tiny):
    store = SessionStore(tiny, max_sessions=2, chunk=4)
    held = []
    for i in range(3):
        h, _ = store.acquire(f"<{i}>", SINK)
        h.session.text = f"<{i}>"
        store.release(h)
        held.append(h)
    assert list(store.sessions) == [held[1].id, held[2].id] and store.evicted[""] == 1
    one = held[1].nbytes()
    store.max_bytes = one + one // 2
    store.release(store.acquire("<1>", SINK)[0])     # touch <1>: now <2> is least recently used
    assert list(store.sessions) == [held[1].id] and store.evicted[""] == 2


def test_bad_policy_spec_is_a_value_error(tiny):
    store = SessionStore(tiny)
    with pytest.raises(ValueError, match="must exceed n_sink"):
        store.acquire("x", PolicySpec("sink", 4, 4))


def test_block_eviction_reaches_the_conversation_cache(tiny):
    """`serve --block B`: the session's cache holds up to budget + B - 1 slots between evictions."""
    store = SessionStore(tiny, chunk=4)
    held, _ = store.acquire("x", PolicySpec("sink", 8, 4, "cache", block=5))
    assert held.policy.block == 5
    assert held.session.cache.layers[0].capacity == 8 + 5 - 1 + 4
    assert store.acquire("x", PolicySpec("sink", 8, 4, "cache"))[0] is not held  # another spec, another cache


def test_owners_evict_only_their_own_within_their_quotas(tiny):
    from attnlab.serve.protocol import APIError
    one = SessionStore(tiny, chunk=4).cache_bytes(SINK)
    store = SessionStore(tiny, max_sessions=4, max_bytes=4 * one, chunk=4, key_sessions=2, key_bytes=2 * one)
    assert store.cache_bytes(SINK) == one and store.held() == []
    bob, _ = store.acquire("<b>", SINK, owner="bob")
    bob.session.text = "<b>"
    store.release(bob)
    mine = []
    for i in range(4):  # alice opens 4 against her quota of 2: only her own are evicted
        h, _ = store.acquire(f"<a{i}>", SINK, owner="alice")
        h.session.text = f"<a{i}>"
        store.release(h)
        mine.append(h)
    assert set(store.sessions) == {bob.id, mine[2].id, mine[3].id}
    assert store.evicted == {"alice": 2} and store.summary("bob")["evicted"] == 0
    assert store.summary("alice")["max_sessions"] == 2 and store.summary()["max_sessions"] == 4
    busy = [store.acquire(f"<a{i}>", SINK, owner="alice")[0] for i in (2, 3)]  # both of hers busy: no room
    with pytest.raises(APIError) as e:
        store.acquire("<a9>", SINK, owner="alice")
    assert e.value.status == 503 and e.value.code == "cache_full" and bob.id in store.sessions
    for h in busy:
        store.release(h)
