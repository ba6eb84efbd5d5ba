"""Shared-memory side channel for a client and a server on the same host.

gRPC then carries only the control message (a ``SharedMemoryRef``); the bulk bytes are
written once into a file in ``/dev/shm`` that both processes map. A client first proves the
server can see its memory (``ProbeSharedMemory``: the server reads a random nonce back), so
processes on different hosts or in different containers fall back to gRPC chunks by
themselves.

* Regions are files ``/dev/shm/shardps-<random>`` created by the client with mode 0600 and
  unlinked when the client closes; their names carry 128 random bits.
* The server maps a region on first use and keeps the mapping while it is used (unmapped
  after ``idle_seconds`` or beyond ``max_regions``); it only opens names of that form and
  checks every offset and length against the file's size.
"""

from __future__ import annotations

import bisect
import mmap
import operator
import os
import re
import secrets
import threading
import time

from shardps.errors import InvalidArgument, PermissionDenied, ResourceExhausted, UnknownRegion

SHM_DIR = "/dev/shm"
NAME_RE = re.compile(r"shardps-[0-9a-f]{16,64}")     # whole-string matches only (fullmatch)
_SIZE = operator.attrgetter("size")


class Region:
    """A shared-memory file mapped into this process (read-write)."""

    def __init__(self, name: str, size: int, create: bool):
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            else:
                size = os.fstat(fd).st_size
            self.size = size
            self.mm = mmap.mmap(fd, size) if size else None
        finally:
            os.close(fd)
        self.owner = create
        self.last_used = time.monotonic()

    def view(self, offset: int = 0, length: int | None = None) -> memoryview:
        length = self.size - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > self.size:
            raise InvalidArgument(f"shared-memory range [{offset}, {offset + length}) is outside "
                                  f"{self.name} ({self.size} bytes)")
        return memoryview(self.mm)[offset:offset + length] if self.mm is not None else memoryview(b"")

    def close(self) -> bool:
        """Unmap (and unlink if this process created it). False if views are still alive."""
        try:
            if self.mm is not None:
                self.mm.close()
        except BufferError:
            return False
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        return True


class ServerRegions:
    """The regions a server has mapped, by name. Thread-safe."""

    def __init__(self, max_regions: int = 64, idle_seconds: float = 60.0):
        self.max_regions = max_regions
        self.idle_seconds = idle_seconds
        self._lock = threading.Lock()
        self._regions: dict[str, Region] = {}
        self._owner: dict[str, str] = {}      # region name -> the job that proved it

    def bind(self, name: str, job: str) -> bool:
        """Bind a region to the job that proved it; False if another job holds it."""
        with self._lock:
            owner = self._owner.setdefault(name, job)
            return owner == job

    def bound(self, name: str, job: str) -> bool:
        """Whether region ``name`` is bound to ``job`` (a dict read: a caller that keeps a
        region's view checks this before each use)."""
        return self._owner.get(name) == job

    def view_for(self, name: str, offset: int, length: int, job: str) -> memoryview:
        """A view of a region bound to ``job`` (see ``bind``). PermissionDenied if another job
        holds it, UnknownRegion if no job proved it to this process."""
        with self._lock:
            owner = self._owner.get(name)
        if owner is None:
            raise UnknownRegion(f"shared-memory region {name!r} was not proved by job {job!r}: "
                                f"call ProbeSharedMemory first")
        if owner != job:
            raise PermissionDenied(f"shared-memory region {name!r} belongs to another job, not "
                                   f"{job!r}: regions are not shared between jobs")
        return self.view(name, offset, length)

    def view(self, name: str, offset: int, length: int) -> memoryview:
        if not NAME_RE.fullmatch(name or ""):
            raise InvalidArgument(f"shared-memory name {name!r} is not a shardps region "
                                  f"(shardps-<hex>)")
        with self._lock:
            region = self._regions.get(name)
            if region is None or region.size < offset + length:
                if region is not None:
                    region.close()
                try:
                    region = Region(name, 0, create=False)
                except FileNotFoundError:
                    raise InvalidArgument(f"shared-memory region {name!r} does not exist on this "
                                          f"host: send the data in chunks") from None
                self._regions[name] = region
            region.last_used = time.monotonic()
            self._evict_locked()
            return region.view(offset, length)

    def _evict_locked(self) -> None:
        now = time.monotonic()
        by_age = sorted(self._regions.values(), key=lambda r: r.last_used)
        excess = len(by_age) - self.max_regions
        for i, region in enumerate(by_age):
            if i < excess or now - region.last_used > self.idle_seconds:
                if region.close():
                    del self._regions[region.name]
                    if not os.path.exists(region.path):     # the client is gone
                        self._owner.pop(region.name, None)

    def close(self) -> None:
        with self._lock:
            for region in self._regions.values():
                region.close()
            self._regions.clear()


class ClientRegions:
    """A pool of regions a client writes requests into and servers write replies into.
    ``acquire`` hands a region of at least ``size`` bytes to one call (the smallest free one
    that fits: the free ones are kept by size); ``release`` returns it. Thread-safe."""

    def __init__(self, max_bytes: int = 1 << 31):
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._free: list[Region] = []
        self._all: list[Region] = []

    def acquire(self, size: int) -> Region:
        with self._lock:
            for k, free in enumerate(self._free):   # smallest first: the first that fits
                if free.size >= size:
                    return self._free.pop(k)
            total = sum(r.size for r in self._all)
            capacity = max(1 << 20, 1 << (max(size, 1) - 1).bit_length())
            if total + capacity > self.max_bytes:
                if self._free:                       # make room: drop the smallest free ones
                    for r in list(self._free):          # kept by size: smallest first
                        self._free.remove(r)
                        self._all.remove(r)
                        r.close()
                        total -= r.size
                        if total + capacity <= self.max_bytes:
                            break
                if total + capacity > self.max_bytes:
                    raise ResourceExhausted(f"shared-memory pool is full ({total} bytes in use)")
            region = Region(f"shardps-{secrets.token_hex(16)}", capacity, create=True)
            self._all.append(region)
            return region

    def release(self, region: Region) -> None:
        """Give back a region whose call was answered: the next call may reuse it."""
        with self._lock:
            bisect.insort(self._free, region, key=_SIZE)

    def retire(self, region: Region) -> None:
        """Drop a region whose call failed without an answer (a timeout, a broken
        connection): the server may still read the request from it, or write a reply into
        it, so no later call writes it again. Its file is unlinked; a server that mapped it
        keeps its pages until it lets go, and one that had not finds it gone (the request is
        then refused, not misread)."""
        with self._lock:
            if region in self._all:
                self._all.remove(region)
        if not region.close() and region.owner:      # views still alive: unmapped when they go
            try:
                os.unlink(region.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        with self._lock:
            for region in self._all:
                region.close()
            self._all.clear()
            self._free.clear()


def available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)
