"""A worker's local state as bytes that cannot run code when read: safetensors plus JSON.

Checkpoints keep each worker's local state (``CheckpointBarrier.worker_state``) and a restore
hands it to whichever worker takes that rank (``GetWorkerState``), so the bytes one worker
wrote are read by another. They must therefore never be unpickled: a pickle (``torch.save``)
runs whatever code its author put in it. ``encode`` writes, and ``decode`` accepts, only:

* one safetensors file holding every tensor of the state, named by its path in the state
  (``"local/1.running_mean"``, ``"torch_rng"``);
* in that file's metadata, ``format`` = ``FORMAT`` and ``document``: the state as JSON, each
  tensor replaced by ``{"__tensor__": "<its name>"}`` and each dict whose keys are not all
  strings (optimizer state is keyed by parameter index) by ``{"__items__": [[key, value],
  ...]}``.

A state is a nest of dicts, lists (tuples come back as lists), str, int, float, bool, None and
torch tensors (moved to the CPU). ``decode`` refuses anything else, pickles included, with
InvalidArgument and never executes anything it reads.
"""

from __future__ import annotations

import json

from shardps.errors import InvalidArgument

FORMAT = "shardps.worker_state/1"
_TENSOR, _ITEMS = "__tensor__", "__items__"
_MAX_HEADER = 100 << 20          # safetensors' own limit on the JSON header


def encode(state: dict) -> bytes:
    """``state`` as safetensors bytes with the JSON document in the metadata.
    TypeError (naming the path) for a value of an unsupported type."""
    import torch
    from safetensors.torch import save
    tensors: dict[str, torch.Tensor] = {}

    def walk(value, path: str):
        if isinstance(value, torch.Tensor):
            name, k = path or "tensor", 1
            while name in tensors:
                name, k = f"{path}#{k}", k + 1
            # a private copy: safetensors refuses tensors that share storage
            tensors[name] = value.detach().to("cpu", copy=True).contiguous()
            return {_TENSOR: name}
        if isinstance(value, dict):
            if all(isinstance(k, str) for k in value) and not {_TENSOR, _ITEMS} & set(value):
                return {k: walk(v, f"{path}/{k}" if path else k) for k, v in value.items()}
            for k in value:
                if not isinstance(k, (str, int, float, bool)) and k is not None:
                    raise TypeError(f"worker state {path or '/'}: key {k!r} of type "
                                    f"{type(k).__name__} (keys are str, int, float, bool or None)")
            return {_ITEMS: [[k, walk(v, f"{path}/{k}" if path else str(k))] for k, v in value.items()]}
        if isinstance(value, (list, tuple)):
            return [walk(v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(value)]
        if value is None or isinstance(value, (str, int, float, bool)):
            return value
        raise TypeError(f"worker state {path or '/'}: a {type(value).__name__} cannot be stored "
                        f"(use tensors, dicts, lists, str, int, float, bool or None)")

    document = walk(state, "")
    return save(tensors, metadata={"format": FORMAT, "document": json.dumps(document)})


def decode(raw: bytes) -> dict:
    """The state ``encode`` wrote. InvalidArgument for anything else: a pickle or
    ``torch.save`` archive, a safetensors file without the document, a malformed document."""
    from safetensors.torch import load
    raw = bytes(raw)
    if raw[:1] == b"\x80" or raw[:2] == b"PK":
        raise InvalidArgument("worker state is a pickle (torch.save format): refused, since "
                              f"unpickling runs code; workers write {FORMAT} (safetensors + JSON)")
    metadata = _metadata(raw)
    if metadata.get("format") != FORMAT or "document" not in metadata:
        raise InvalidArgument(f"worker state: safetensors metadata format "
                              f"{metadata.get('format')!r}, not {FORMAT!r} with a document")
    try:
        document = json.loads(metadata["document"])
        tensors = load(raw)
    except Exception as exc:        # safetensors raises its own error types
        raise InvalidArgument(f"worker state: unreadable ({type(exc).__name__}: {exc})") from None
    state = _rebuild(document, tensors, "")
    if not isinstance(state, dict):
        raise InvalidArgument(f"worker state: the document is a {type(state).__name__}, not a dict")
    return state


def _metadata(raw: bytes) -> dict:
    """The ``__metadata__`` of a safetensors header (8 bytes little-endian length, JSON)."""
    size = int.from_bytes(raw[:8], "little") if len(raw) >= 8 else -1
    if not 0 < size <= min(len(raw) - 8, _MAX_HEADER):
        raise InvalidArgument(f"worker state: not a safetensors file ({len(raw)} bytes, header "
                              f"length {size}); workers write {FORMAT}")
    try:
        header = json.loads(raw[8:8 + size])
    except ValueError:
        raise InvalidArgument("worker state: the safetensors header is not JSON") from None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return metadata if isinstance(metadata, dict) else {}


def _rebuild(node, tensors: dict, path: str):
    if isinstance(node, list):
        return [_rebuild(v, tensors, f"{path}/{i}") for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    if _TENSOR in node:
        name = node[_TENSOR]
        if len(node) != 1 or not isinstance(name, str) or name not in tensors:
            raise InvalidArgument(f"worker state {path or '/'}: tensor reference {node!r} names "
                                  f"no tensor of the file")
        return tensors[name]
    if _ITEMS in node:
        items = node[_ITEMS]
        if len(node) != 1 or not isinstance(items, list) or not all(
                isinstance(p, list) and len(p) == 2 and not isinstance(p[0], (list, dict)) for p in items):
            raise InvalidArgument(f"worker state {path or '/'}: {_ITEMS} must be [[key, value], ...]")
        return {k: _rebuild(v, tensors, f"{path}/{k}") for k, v in items}
    return {k: _rebuild(v, tensors, f"{path}/{k}") for k, v in node.items()}
