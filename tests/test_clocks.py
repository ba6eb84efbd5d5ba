"""Worker clocks (SYNC / SSP) on a fake clock: what a wait that times out says."""

import pytest

from shardps.errors import DeadlineExceeded
from shardps.server.node.clocks import JobClock
from shardps.tables import Consistency


class FakeTime:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("mode, staleness, pull_clock", [(Consistency.SYNC, 0, 1), (Consistency.BOUNDED, 1, 2)])
def test_a_wait_that_times_out_names_the_ranks_and_steps_it_waited_for(mode, staleness, pull_clock):
    now = FakeTime()
    clock = JobClock(mode, staleness, now)
    clock.set_members({"a", "b", "c"}, mode, staleness, {"a": 0, "b": 1, "c": 2})
    clock.report("a", 0)                       # rank 0 completed step 0; ranks 1 and 2 did not
    clock.report("c", 0)
    clock.report("a", 1)
    with pytest.raises(DeadlineExceeded) as err:
        clock.wait_for_pull(pull_clock, deadline=now.now)      # already due: no waiting
    assert "rank 1 (0 steps completed)" in err.value.message, err.value.message
    assert "rank 0" not in err.value.message


def test_ssp_is_named_ssp_and_every_old_spelling_is_still_accepted():
    from shardps.errors import InvalidArgument
    from shardps.worker.client import parse_consistency
    assert Consistency.SSP is Consistency.BOUNDED and str(Consistency.SSP) == "ssp"
    assert [str(m) for m in Consistency] == ["async", "sync", "ssp"]
    for text, mode in [("ssp", Consistency.SSP), ("BOUNDED", Consistency.SSP), ("Sync", Consistency.SYNC),
                       ("bsp", Consistency.SYNC), ("asp", Consistency.ASYNC), ("async", Consistency.ASYNC)]:
        assert Consistency.parse(text) is mode and Consistency(text) is mode and parse_consistency(text) is mode
    assert Consistency["BOUNDED"] is Consistency.SSP and Consistency(3) is Consistency.SSP   # state files, protos
    with pytest.raises(InvalidArgument, match="'lazy': use async, sync or ssp"):
        Consistency.parse("lazy")


def test_a_sync_clock_takes_a_push_one_step_ahead_and_refuses_two():
    """A server that waits for a report lost to a map change (or to its previous incarnation)
    is one step behind the pusher: that push is taken; two steps ahead is no real worker's."""
    clock = JobClock(Consistency.SYNC)
    clock.set_members({"a", "b"}, Consistency.SYNC, 0)
    assert clock.adopt(3, pushing=True)            # fresh: learns step 3
    assert clock.applied_steps == 3
    assert clock.adopt(4, pushing=True)            # one ahead: b's report of 3 not here yet
    assert not clock.adopt(5, pushing=True)
    assert clock.adopt(5, pushing=False) is False  # a pull never moves a clock that took a push
    assert clock.applied_steps == 3


def test_a_worker_that_completed_a_sync_step_and_left_still_counts_in_its_mean():
    clock = JobClock(Consistency.SYNC, 0, FakeTime())
    clock.set_members({"a", "b", "c"}, Consistency.SYNC, 0)
    clock.report("a", 0)                       # a pushed step 0 (its gradients are accumulated) ...
    clock.set_members({"b", "c"}, Consistency.SYNC, 0)     # ... and left before b and c did
    clock.report("b", 0)
    clock.report("c", 0)
    assert clock.steps_to_apply() == range(0, 1)
    assert clock.workers_of(0) == 3            # the mean of step 0 is over a, b and c
    clock.mark_applied(0)
    assert clock.workers_of(1) == 2 and clock.departed == {}
    clock.set_members({"b"}, Consistency.SYNC, 0)          # c left before completing step 1
    assert clock.workers_of(1) == 1
