"""engine/scheduler.py: what each step computes, admission by free pages, chunked prefill and preemption."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from redline.engine.kv_pages import PagePool
from redline.engine.batch import Sequence
from redline.engine.scheduler import Scheduler


def seq(name: str, prompt_len: int, first: int = 0) -> Sequence:
    return Sequence(name, list(range(first, first + prompt_len)), prompt_len, max_new_tokens=100)


def run(scheduler: Scheduler, token: int = 7) -> list[tuple[str, int, int]]:
    """One step: schedule, 'compute' it, append a token to every sampling sequence. Returns (name, start, length)."""
    chunks = scheduler.schedule()
    scheduler.commit(chunks)
    for c in chunks:
        if c.samples:
            c.seq.tokens.append(token)
    return [(c.seq.request_id, c.start, c.length) for c in chunks]


def test_decode_rows_come_first_and_long_prompts_are_chunked():
    scheduler = Scheduler(PagePool(64, 4), prefill_chunk=8)
    scheduler.add(seq("a", 3))
    assert run(scheduler) == [("a", 0, 3)]
    scheduler.add(seq("long", 20, first=100))
    assert run(scheduler) == [("a", 3, 1), ("long", 0, 8)]  # a keeps decoding while long prefills
    assert run(scheduler) == [("a", 4, 1), ("long", 8, 8)]
    assert run(scheduler) == [("a", 5, 1), ("long", 16, 4)]  # long's last chunk samples its first token
    assert run(scheduler) == [("a", 6, 1), ("long", 20, 1)]


def test_admission_waits_for_free_pages():
    pool = PagePool(4, 4)
    scheduler = Scheduler(pool, prefill_chunk=64)
    scheduler.add(seq("a", 9))  # 3 pages
    scheduler.add(seq("b", 6, first=50))  # 2 pages: must wait
    assert run(scheduler) == [("a", 0, 9)]
    assert [s.request_id for s in scheduler.waiting] == ["b"]
    scheduler.finish(scheduler.running[0], "length")
    assert pool.num_free == 4
    assert run(scheduler) == [("b", 0, 6)]


def test_max_running_caps_admission():
    scheduler = Scheduler(PagePool(64, 4), max_running=2)
    for name in "abc":
        scheduler.add(seq(name, 2, first=ord(name)))
    assert [c[0] for c in run(scheduler)] == ["a", "b"]
    assert [s.request_id for s in scheduler.waiting] == ["c"]


def test_out_of_pages_preempts_the_newest_and_it_recomputes_later():
    pool = PagePool(4, 4)
    scheduler = Scheduler(pool)
    scheduler.add(seq("old", 8))  # 2 pages, full: its next token needs a third
    scheduler.add(seq("new", 7, first=40))  # 2 pages
    assert run(scheduler) == [("old", 0, 8), ("new", 0, 7)]
    assert pool.num_free == 0
    steps = run(scheduler)  # old needs a page: new is preempted, and its decode row dropped
    assert steps == [("old", 8, 1)] and scheduler.preemptions == 1
    new = scheduler.waiting[0]
    assert new.request_id == "new" and new.pages == [] and new.num_computed == 0 and new.num_tokens == 8
    scheduler.finish(scheduler.running[0], "length")
    # Recomputed from the start, its sampled token included (one full page is served from the prefix cache).
    assert run(scheduler) == [("new", 4, 4)]
    assert new.cached_tokens == 4


def test_a_lone_sequence_that_outgrows_the_pool_ends_with_an_error():
    pool = PagePool(2, 2)
    scheduler = Scheduler(pool)
    scheduler.add(seq("a", 4))
    run(scheduler)
    assert run(scheduler) == []
    assert [s.finish_reason for s in scheduler.failed] == ["error"]
    assert "raise max_kv_tokens" in scheduler.failed[0].error and pool.num_free == 2


def test_finish_releases_pages_and_prefix_pages_are_shared():
    pool = PagePool(16, 4)
    scheduler = Scheduler(pool)
    first = seq("first", 10)
    scheduler.add(first)
    run(scheduler)
    scheduler.finish(first, "stop")
    assert pool.num_free == 16 and first.finish_reason == "stop"
    again = seq("again", 10)
    scheduler.add(again)
    assert run(scheduler) == [("again", 8, 2)]  # two full pages from the cache
    assert again.cached_tokens == 8 and pool.hits == 8 and pool.queries == 20


def test_bad_settings_and_oversized_sequences_are_refused():
    with pytest.raises(ValueError, match="prefill_chunk"):
        Scheduler(PagePool(4, 4), prefill_chunk=0)
    with pytest.raises(ValueError, match="cannot fit"):
        Scheduler(PagePool(2, 4)).add(seq("big", 9))


def check_pool(scheduler: Scheduler) -> None:
    """Every page is free, cached or held, and held exactly as often as sequences list it."""
    pool = scheduler.pool
    holders = [0] * pool.num_pages
    for s in scheduler.running:
        assert len(s.pages) >= pool.pages_for(s.num_computed) and len(set(s.pages)) == len(s.pages)
        for page in s.pages:
            holders[page] += 1
    for s in scheduler.waiting:
        assert s.pages == [] and s.num_computed == 0
    assert holders == pool.ref_counts
    free, cached = set(pool.free), set(pool.cached)
    assert not free & cached and len(free) == len(pool.free)
    assert all((pool.ref_counts[p] == 0) == (p in free or p in cached) for p in range(pool.num_pages))
    assert all(p in pool.key_of for p in cached) and not any(p in pool.key_of for p in free)
    shared = [p for p in range(pool.num_pages) if holders[p] > 1]
    assert all(p in pool.key_of for p in shared)  # only full, keyed prefix pages are shared


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_traffic_keeps_the_pool_consistent(data):
    pool = PagePool(data.draw(st.integers(6, 24)), data.draw(st.sampled_from([2, 4])))
    scheduler = Scheduler(pool, max_running=data.draw(st.integers(1, 5)), prefill_chunk=data.draw(st.integers(1, 9)))
    limit = {}
    for step in range(60):
        if data.draw(st.booleans()):
            prompt = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=12))  # few symbols: prefix hits
            new = data.draw(st.integers(1, 8))
            if len(prompt) + new - 1 <= pool.capacity_tokens:
                s = Sequence(f"r{step}", prompt, len(prompt), new)
                scheduler.add(s)
                limit[s.request_id] = new
        chunks = scheduler.schedule()
        scheduler.commit(chunks)
        for c in chunks:
            if c.samples:
                c.seq.tokens.append(data.draw(st.integers(0, 2)))
                if c.seq.num_new >= limit[c.seq.request_id]:
                    scheduler.finish(c.seq, "length")
        if scheduler.running and data.draw(st.booleans()):
            scheduler.finish(data.draw(st.sampled_from(scheduler.running)), "abort")
        assert not scheduler.failed
        check_pool(scheduler)
    for s in list(scheduler.running) + list(scheduler.waiting):
        scheduler.finish(s, "abort")
    assert pool.num_free == pool.num_pages
