"""How a worker moves a step's pulled values to its device and its gradients back.

On the CPU nothing moves: ``to_device`` wraps the pulled numpy array (``torch.from_numpy``, no
copy) and ``to_host_all`` returns views of the gradients (``.numpy()``), as before.

On a GPU (``DeviceCopies``, one per ``PSModel``):

* ``to_device``: the array is copied into a pinned host staging buffer from a small pool (one
  per dtype; ``choose_staging`` decides which buffer, purely), then to the device with a
  non-blocking copy on the device's copy stream; ``to_device_all`` stages several arrays
  of one dtype (a step's dense values) in one buffer and copies them together. The compute stream waits for that copy on
  the GPU (an event), the training thread does not. A staging buffer is written again only
  once the event recorded after its copy has completed.
* ``to_host_all``: the copy of every gradient into pinned host memory is started on the copy
  stream (after the work queued on the compute stream so far: the backward), then the
  training thread waits once, for all of them. Each returned array owns its buffer (from
  torch's pinned-memory cache, which reuses a buffer only once its array is gone), so a push
  that sends it later (held for the next pull, or in flight with ``overlap``) reads it intact.

Not thread-safe: the training thread drives it.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol, Sequence

import numpy as np
import torch

_ON_CPU = operator.attrgetter("is_cpu")

MIN_STAGING_BYTES = 64 << 10      # a staging buffer's least size: small pulls share one size
MAX_STAGING_BUFFERS = 16          # per dtype: copies in flight at once before the host waits


class SlotView(NamedTuple):
    """What ``choose_staging`` sees of a staging buffer."""

    capacity: int       # elements
    busy: bool          # the copy last issued from it has not completed
    issued: int         # when that copy was issued (a counter: one copy stream runs them in order)


@dataclass(frozen=True)
class Staging:
    """Which staging buffer a copy uses: ``index`` (``len(slots)``: a new one), its capacity
    from now on (larger than today's: reallocate it), and whether its copy in flight must be
    waited for first (every buffer busy and the pool full)."""

    index: int
    capacity: int
    wait: bool = False


def staging_capacity(need: int, itemsize: int) -> int:
    """Elements of a buffer allocated for ``need`` elements of ``itemsize`` bytes: the next
    power of two, at least ``MIN_STAGING_BYTES``; a buffer regrown this way at least doubles."""
    least = max(1, -(-MIN_STAGING_BYTES // max(1, itemsize)))
    return 1 << (max(need, least) - 1).bit_length()


def choose_staging(slots: Sequence[SlotView], need: int, itemsize: int,
                   max_buffers: int = MAX_STAGING_BUFFERS) -> Staging:
    """The staging buffer for a copy of ``need`` elements. Pure. In order of preference: the
    smallest idle buffer that fits; the largest idle one, regrown; a new one while there are
    fewer than ``max_buffers``; else the one issued first (it completes first), after waiting
    for it, regrown if too small. Buffers never shrink."""
    idle = [i for i, s in enumerate(slots) if not s.busy]
    fits = [i for i in idle if slots[i].capacity >= need]
    if fits:
        best = min(fits, key=lambda i: slots[i].capacity)
        return Staging(best, slots[best].capacity)
    if idle:
        largest = max(idle, key=lambda i: slots[i].capacity)
        return Staging(largest, staging_capacity(need, itemsize))
    if len(slots) < max_buffers:
        return Staging(len(slots), staging_capacity(need, itemsize))
    oldest = min(range(len(slots)), key=lambda i: slots[i].issued)
    capacity = slots[oldest].capacity
    return Staging(oldest, capacity if capacity >= need else staging_capacity(need, itemsize), wait=True)


class CopyEvent(Protocol):
    """What the pool needs of ``torch.cuda.Event``."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


def pinned(dtype: torch.dtype, capacity: int) -> torch.Tensor:
    """A pinned (page-locked) host buffer of ``capacity`` elements: the GPU copies from it
    without staging it again, and asynchronously."""
    return torch.empty(capacity, dtype=dtype, pin_memory=True)


@dataclass
class _Slot:
    buffer: torch.Tensor
    event: CopyEvent | None = None      # recorded after the copy last issued from the buffer
    issued: int = 0

    def state(self) -> SlotView:
        return SlotView(self.buffer.numel(), self.event is not None and not self.event.query(), self.issued)


class StagingPool:
    """Staging buffers per dtype (see the module docstring). ``take`` returns a buffer whose
    previous copy has completed; the caller records the event of its new copy with
    ``issued``. ``allocate`` makes a buffer (pinned host memory by default)."""

    def __init__(self, allocate: Callable[[torch.dtype, int], torch.Tensor] = pinned,
                 max_buffers: int = MAX_STAGING_BUFFERS):
        self.allocate = allocate
        self.max_buffers = max_buffers
        self.slots: dict[np.dtype, list[_Slot]] = {}
        self._issued = 0

    def take(self, dtype: np.dtype, need: int) -> _Slot:
        """A buffer of at least ``need`` elements of ``dtype`` that no copy in flight reads."""
        slots = self.slots.setdefault(np.dtype(dtype), [])
        choice = choose_staging([s.state() for s in slots], need, np.dtype(dtype).itemsize, self.max_buffers)
        if choice.index == len(slots):
            slots.append(_Slot(self.allocate(torch_dtype(dtype), choice.capacity)))
        slot = slots[choice.index]
        if choice.wait and slot.event is not None:
            slot.event.synchronize()
        if choice.capacity != slot.buffer.numel():
            slot.buffer = self.allocate(torch_dtype(dtype), choice.capacity)
        return slot

    def issued(self, slot: _Slot, event: CopyEvent) -> None:
        """A copy from ``slot``'s buffer was issued; ``event`` completes with it."""
        self._issued += 1
        slot.event, slot.issued = event, self._issued


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of a numpy dtype (as ``torch.from_numpy`` maps it)."""
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


class DeviceCopies:
    """Host-to-device copies of pulled values and device-to-host copies of gradients for
    one training loop (see the module docstring). ``pool``: the staging buffers."""

    def __init__(self, pool: StagingPool | None = None):
        self.pool = pool or StagingPool()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        # the training thread's time in GPU copies (staging, issuing, waiting for gradients):
        # the "copies" part of a GPU worker's step; 0 on the CPU, where nothing is copied
        self.seconds = 0.0

    def copy_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The stream ``device``'s copies run on (one per device, made on first use)."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    def to_device(self, array: np.ndarray, device: torch.device) -> torch.Tensor:
        """``array`` on ``device``. The CPU: ``torch.from_numpy(array)`` (shares its memory).
        A GPU: a new tensor, ready for the work queued on the current stream after this call
        (the stream waits for the copy; the host does not). Does not block."""
        return self.to_device_all([array], device)[0]

    def to_device_all(self, arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
        """Each array on ``device``, as ``to_device`` gives it; on a GPU the arrays of one
        dtype travel together: one staging buffer, one copy, each tensor a view of it (a
        step's dense values are a handful of small arrays, each a copy and an event of its
        own otherwise)."""
        if device.type == "cpu":
            return list(map(torch.from_numpy, arrays))
        if device.type != "cuda":
            return [torch.from_numpy(a).to(device) for a in arrays]
        started = time.perf_counter()
        out: list[torch.Tensor | None] = [None] * len(arrays)
        by_dtype: dict[np.dtype, list[int]] = {}
        for i, a in enumerate(arrays):
            if a.size:
                by_dtype.setdefault(a.dtype, []).append(i)
            else:
                out[i] = torch.from_numpy(a).to(device)
        stream, compute = self.copy_stream(device), torch.cuda.current_stream(device)
        for dtype, members in by_dtype.items():
            offsets = np.cumsum([0] + [arrays[i].size for i in members])
            slot = self.pool.take(dtype, int(offsets[-1]))
            staged = slot.buffer[:int(offsets[-1])]
            host = staged.numpy()
            for i, lo, hi in zip(members, offsets[:-1], offsets[1:]):
                np.copyto(host[lo:hi].reshape(arrays[i].shape), arrays[i])
            event = torch.cuda.Event()
            with torch.cuda.stream(stream):
                together = torch.empty(staged.shape, dtype=staged.dtype, device=device)   # the copy stream's memory
                together.copy_(staged, non_blocking=True)
                event.record(stream)
            self.pool.issued(slot, event)
            compute.wait_event(event)
            together.record_stream(compute)     # freed later: not reused before the compute stream is done with it
            for i, lo, hi in zip(members, offsets[:-1], offsets[1:]):
                out[i] = together[lo:hi].view(arrays[i].shape)
        self.seconds += time.perf_counter() - started
        return out      # type: ignore[return-value]

    def to_host_all(self, tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
        """Each tensor as a numpy array on the host. The CPU: ``tensor.detach().numpy()`` (a
        view). A GPU: every copy is started, then one wait for them all; each array owns its
        pinned buffer."""
        if all(map(_ON_CPU, tensors)):         # the CPU: views, the tensors walked in C
            return list(map(torch.Tensor.numpy, map(torch.Tensor.detach, tensors)))
        started = time.perf_counter()
        out: list[np.ndarray | torch.Tensor] = []
        waited: dict[torch.device, torch.cuda.Stream] = {}
        for tensor in tensors:
            tensor = tensor.detach()
            if tensor.device.type != "cuda":
                out.append(tensor.cpu().numpy())
                continue
            stream = waited.get(tensor.device)
            if stream is None:
                stream = waited[tensor.device] = self.copy_stream(tensor.device)
                stream.wait_stream(torch.cuda.current_stream(tensor.device))    # the backward
            with torch.cuda.stream(stream):
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                host.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)    # a gradient freed now is not reused before its copy is done
            out.append(host)
        for stream in waited.values():
            stream.synchronize()
        if waited:
            self.seconds += time.perf_counter() - started
        return [a.numpy() if isinstance(a, torch.Tensor) else a for a in out]
