"""The exactly-once records of blocks (``server/node/blocks.py``): the blocks of a push share
one record while their histories agree, and a push to only some of them never changes what
the others have seen."""

from __future__ import annotations

from shardps.server.node.blocks import Writer, applied_any, new_block, remember_all
from shardps.tables import TableKind, TableSpec

SPEC = TableSpec("w", TableKind.DENSE, (40,), num_blocks=4)


def _blocks():
    return [new_block(("job", "w", b), SPEC) for b in range(4)]


def _push(seq: int, low: int = 0) -> Writer:
    return Writer("session", 1, seq, low)


def test_the_blocks_of_a_push_share_one_record_updated_once():
    blocks = _blocks()
    remember_all(blocks, _push(1))
    record = blocks[0].writers[("session", 1)]
    assert all(blk.writers[("session", 1)] is record for blk in blocks)
    remember_all(blocks, _push(2, low=2))
    assert all(blk.writers[("session", 1)] is record for blk in blocks)        # updated in place
    assert record.acked_below == 2 and applied_any(blocks, _push(2)) and applied_any(blocks, _push(1))
    assert not applied_any(blocks, _push(3))


def test_a_push_to_some_of_the_blocks_leaves_the_others_records_alone():
    a, b, c, d = blocks = _blocks()
    remember_all(blocks, _push(1))
    remember_all([a, b], _push(2))                   # c and d did not apply 2
    assert applied_any([a], _push(2)) and applied_any([b], _push(2))
    assert not applied_any([c], _push(2)) and not applied_any([d], _push(2)) and not applied_any([c, d], _push(2))
    assert a.writers[("session", 1)] is b.writers[("session", 1)]               # a and b agree again
    assert c.writers[("session", 1)] is not a.writers[("session", 1)]
    remember_all([c], _push(2))                      # a retry re-routed to c alone: now c has it
    assert applied_any([c], _push(2)) and not applied_any([d], _push(2))
    remember_all(blocks, _push(3))                   # the four differ (d lacks 2): records of their own
    assert not applied_any([d], _push(2)) and all(applied_any([blk], _push(3)) for blk in blocks)
    assert len({id(blk.writers[("session", 1)]) for blk in blocks}) == 4
    remember_all(blocks, _push(4, low=4))            # all acknowledged below 4: they agree and share again
    assert len({id(blk.writers[("session", 1)]) for blk in blocks}) == 1
    assert applied_any([d], _push(2)) and not applied_any(blocks, _push(5))


def test_a_block_whose_record_was_dropped_or_reloaded_gets_one_of_its_own():
    a, b, c, d = blocks = _blocks()
    remember_all(blocks, _push(1))
    b.forget_writers(set())                          # b's writer left the group
    remember_all(blocks, _push(2))
    assert not applied_any([b], _push(1)) and applied_any([b], _push(2)) and applied_any([a], _push(1))
    reloaded = new_block(c.key, SPEC)                # c loaded afresh from a snapshot of it
    reloaded._load_metadata(c._metadata())
    remember_all([a, b, reloaded, d], _push(3))
    assert not applied_any([c], _push(3))            # the dropped object never sees later pushes
    assert applied_any([reloaded], _push(3)) and applied_any([reloaded], _push(1))
