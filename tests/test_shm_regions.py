"""``shm.ClientRegions``: a client's pool of shared-memory regions (real files in /dev/shm)."""

from __future__ import annotations

import pytest

from shardps.errors import ResourceExhausted
from shardps.rpc.shm import ClientRegions, available

pytestmark = pytest.mark.skipif(not available(), reason="no writable /dev/shm")


def test_a_call_gets_the_smallest_free_region_that_fits_and_regions_are_reused():
    pool = ClientRegions()
    try:
        big, small = pool.acquire(3 << 20), pool.acquire(100)
        assert (big.size, small.size) == (4 << 20, 1 << 20)
        pool.release(big)
        pool.release(small)
        assert pool.acquire(10) is small                 # both fit: the smaller
        assert pool.acquire(2 << 20) is big
        pool.release(small)
        assert pool.acquire(1 << 20) is small
        third = pool.acquire(1 << 20)                     # none free: a new one
        assert third not in (big, small)
    finally:
        pool.close()


def test_a_full_pool_drops_free_regions_to_make_room_then_refuses():
    pool = ClientRegions(max_bytes=3 << 20)
    try:
        a, b = pool.acquire(1), pool.acquire(1)
        pool.release(a)
        c = pool.acquire(2 << 20)                        # 1 + 1 + 2 MiB: the free one is dropped
        assert c.size == 2 << 20 and a.mm.closed
        with pytest.raises(ResourceExhausted, match="pool is full"):
            pool.acquire(1 << 20)                         # b and c in use
        pool.release(b)
        assert pool.acquire(1) is b
    finally:
        pool.close()
