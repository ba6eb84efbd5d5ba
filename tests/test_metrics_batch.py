"""``metrics.Batch``: events added from many threads, flushed every ``every`` events and by
the registry's collection meanwhile, are each recorded exactly once."""

from __future__ import annotations

import threading

from shardps.metrics import Batch, FlushingRegistry


def test_every_event_added_from_many_threads_is_recorded_once():
    recorded: list = []
    lock = threading.Lock()

    def record(events: list) -> None:
        with lock:
            recorded.extend(events)

    registry = FlushingRegistry()
    batch = Batch(registry, record, every=7)
    start = threading.Barrier(5)

    def adder(k: int) -> None:
        start.wait()
        for i in range(2_000):
            batch.add((k, i))

    def collector() -> None:
        start.wait()
        for _ in range(100):
            registry.collect()                      # flushes before it reads, as a scrape does

    threads = [threading.Thread(target=adder, args=(k,)) for k in range(4)] + [threading.Thread(target=collector)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    batch.flush()
    assert len(recorded) == 8_000 and set(recorded) == {(k, i) for k in range(4) for i in range(2_000)}
    assert recorded.index((0, 1)) > recorded.index((0, 0))     # a thread's events keep their order
