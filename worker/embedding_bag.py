"""Multi-hot features in the shape TorchRec users know, with the tables on shardps.

    tables = [EmbeddingBagConfig(name="t_items", embedding_dim=16, num_embeddings=10_000,
                                 feature_names=["clicked", "viewed"]),     # two features, one table
              EmbeddingBagConfig(name="t_user", embedding_dim=16, num_embeddings=1_000,
                                 feature_names=["user"], pooling=PoolingType.MEAN)]
    ebc = PSEmbeddingBagCollection(tables)
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=["clicked", "viewed", "user"], values=ids, lengths=lengths)   # key-major, like TorchRec
    pooled = ebc(features)             # KeyedTensor: .values() [B, 48], .to_dict()["user"] [B, 16]

* ``KeyedJaggedTensor``: TorchRec's layout. ``keys`` [K], ``values`` (every id, key-major:
  key 0's bags for the whole batch, then key 1's ...), ``lengths`` [K * B] (or ``offsets``
  [K * B + 1]), optional ``weights`` (``values``' shape). ``kjt[key]`` is a ``JaggedTensor``.
* ``KeyedTensor``: the pooled output, ``values()`` ``[B, sum of dims]`` in key order.
* ``PSEmbeddingBagCollection``: one ``PSEmbeddingBag`` per table in ``embedding_bags`` (keyed
  by table name, as TorchRec's ``ModuleDict``, so the exported state dict has
  ``embedding_bags.{table}.weight``). A table's features share its rows; a lookup of a table
  pulls the distinct ids of all its features once. ``is_weighted=True`` pools with the
  features' weights (SUM pooling only).

With ``PSModel``, ``ps_model.pull(features)`` fetches every table's rows together with the
dense parameters: one pull per server per step for the whole model (see ``PSModel.pull``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Sequence

import torch
from torch import nn

from shardps.errors import InvalidArgument
from shardps.tables import Initializer, OptimizerConfig
from shardps.worker.embeddings import PSEmbeddingBag


class PoolingType(Enum):
    """How a table pools the ids of a bag (TorchRec's names)."""

    SUM = "sum"
    MEAN = "mean"


@dataclass
class EmbeddingBagConfig:
    """One table of a ``PSEmbeddingBagCollection`` (TorchRec's fields, plus the table's
    server-side ``optimizer``, ``init`` and ``num_blocks``). ``feature_names``: the features
    that look up this table (they share its rows)."""

    num_embeddings: int
    embedding_dim: int
    name: str
    feature_names: list[str] = field(default_factory=list)
    pooling: PoolingType = PoolingType.SUM
    optimizer: OptimizerConfig | None = None
    init: Initializer | None = None
    num_blocks: int = 0


class _Jagged:
    """The accessors TorchRec's jagged tensors share (``_values``, ``_lengths``,
    ``_offsets``, ``_weights`` set by the subclass)."""

    _values: torch.Tensor
    _lengths: torch.Tensor
    _offsets: torch.Tensor
    _weights: torch.Tensor | None

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        return self._offsets

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def weights(self) -> torch.Tensor:
        if self._weights is None:
            raise InvalidArgument(f"this {type(self).__name__} has no weights")
        return self._weights


class JaggedTensor(_Jagged):
    """One feature's bags for a batch: ``values`` (the ids), ``lengths`` [B], ``offsets`` [B+1],
    optional ``weights``."""

    def __init__(self, values: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor,
                 weights: torch.Tensor | None = None):
        self._values, self._lengths, self._offsets, self._weights = values, lengths, offsets, weights


def _offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.reshape(-1).to(torch.int64), 0, out=out[1:])
    return out


class KeyedJaggedTensor(_Jagged):
    """Variable-length bags of ids for several features (TorchRec's ``KeyedJaggedTensor``
    layout; see the module docstring). Give ``lengths`` or ``offsets`` (the other is
    derived); ``stride`` (the batch size) defaults to ``len(lengths) // len(keys)``.
    Raises InvalidArgument when the parts disagree."""

    def __init__(self, keys: Sequence[str], values: torch.Tensor, weights: torch.Tensor | None = None,
                 lengths: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                 stride: int | None = None):
        self._keys = list(keys)
        if len(set(self._keys)) != len(self._keys):
            raise InvalidArgument(f"KeyedJaggedTensor keys repeat: {self._keys}")
        self._values = torch.as_tensor(values).reshape(-1)
        if lengths is None and offsets is None:
            raise InvalidArgument("KeyedJaggedTensor needs lengths or offsets")
        if lengths is None:
            assert offsets is not None
            offsets = torch.as_tensor(offsets).reshape(-1).to(torch.int64)
            lengths = offsets[1:] - offsets[:-1]
        lengths = torch.as_tensor(lengths).reshape(-1).to(torch.int64)
        self._lengths = lengths
        self._offsets = _offsets_of(lengths) if offsets is None else torch.as_tensor(offsets).reshape(-1)
        if (lengths < 0).any():
            raise InvalidArgument("KeyedJaggedTensor lengths must be >= 0")
        if int(self._offsets[-1]) != self._values.numel() or int(self._offsets[0]) != 0:
            raise InvalidArgument(f"KeyedJaggedTensor: the lengths cover {int(self._offsets[-1])} values "
                                  f"from {int(self._offsets[0])}; values has {self._values.numel()}")
        if self._keys and lengths.numel() % len(self._keys):
            raise InvalidArgument(f"KeyedJaggedTensor: {lengths.numel()} lengths for {len(self._keys)} keys "
                                  f"(need keys x batch)")
        self._stride = stride if stride is not None else (lengths.numel() // len(self._keys) if self._keys else 0)
        if self._stride * len(self._keys) != lengths.numel():
            raise InvalidArgument(f"KeyedJaggedTensor: stride {self._stride} x {len(self._keys)} keys != "
                                  f"{lengths.numel()} lengths")
        self._weights = None if weights is None else torch.as_tensor(weights).reshape(-1)
        if self._weights is not None and self._weights.numel() != self._values.numel():
            raise InvalidArgument(f"KeyedJaggedTensor: {self._weights.numel()} weights for "
                                  f"{self._values.numel()} values")

    @staticmethod
    def from_lengths_sync(keys: Sequence[str], values: torch.Tensor, lengths: torch.Tensor,
                          weights: torch.Tensor | None = None, stride: int | None = None) -> "KeyedJaggedTensor":
        return KeyedJaggedTensor(keys, values, weights=weights, lengths=lengths, stride=stride)

    @staticmethod
    def from_offsets_sync(keys: Sequence[str], values: torch.Tensor, offsets: torch.Tensor,
                          weights: torch.Tensor | None = None, stride: int | None = None) -> "KeyedJaggedTensor":
        return KeyedJaggedTensor(keys, values, weights=weights, offsets=offsets, stride=stride)

    def keys(self) -> list[str]:
        return list(self._keys)

    def stride(self) -> int:
        """The batch size: bags per key."""
        return self._stride

    def length_per_key(self) -> list[int]:
        return [int(v) for v in self._lengths.reshape(len(self._keys), self._stride).sum(dim=1)] \
            if self._keys else []

    def __getitem__(self, key: str) -> JaggedTensor:
        try:
            k = self._keys.index(key)
        except ValueError:
            raise KeyError(f"feature {key!r} is not in this KeyedJaggedTensor (keys: {self._keys})") from None
        b = self._stride
        start, stop = int(self._offsets[k * b]), int(self._offsets[(k + 1) * b])
        offsets = self._offsets[k * b:(k + 1) * b + 1] - start
        weights = None if self._weights is None else self._weights[start:stop]
        return JaggedTensor(self._values[start:stop], self._lengths[k * b:(k + 1) * b], offsets, weights)

    def to_dict(self) -> dict[str, JaggedTensor]:
        return {k: self[k] for k in self._keys}

    def to(self, device: torch.device | str) -> "KeyedJaggedTensor":
        w = None if self._weights is None else self._weights.to(device)
        return KeyedJaggedTensor(self._keys, self._values.to(device), w, self._lengths.to(device),
                                 self._offsets.to(device), self._stride)


class KeyedTensor:
    """Pooled features side by side: ``values()`` ``[B, sum(length_per_key())]``, key ``k``'s
    columns at ``offset_per_key()[k]:offset_per_key()[k+1]``."""

    def __init__(self, keys: Sequence[str], length_per_key: Sequence[int], values: torch.Tensor):
        self._keys, self._lengths, self._values = list(keys), [int(n) for n in length_per_key], values

    def keys(self) -> list[str]:
        return list(self._keys)

    def values(self) -> torch.Tensor:
        return self._values

    def length_per_key(self) -> list[int]:
        return list(self._lengths)

    def offset_per_key(self) -> list[int]:
        out = [0]
        for n in self._lengths:
            out.append(out[-1] + n)
        return out

    def __getitem__(self, key: str) -> torch.Tensor:
        k = self._keys.index(key)
        offsets = self.offset_per_key()
        return self._values[:, offsets[k]:offsets[k + 1]]

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {k: self[k] for k in self._keys}


class EmbeddingBags(nn.Module):
    """The collection's bags by table name (``bags[name]``; ``nn.ModuleDict``'s state-dict
    keys, without its method names: a table may be called "items" or "keys")."""

    def add(self, name: str, bag: PSEmbeddingBag) -> None:
        if not name or "." in name or (hasattr(self, name) and name not in self._modules):
            raise InvalidArgument(f"table name {name!r}: must be non-empty, without '.', and not the name of "
                                  f"an nn.Module attribute")
        if name in self._modules:
            raise InvalidArgument(f"two tables named {name!r}")
        self.add_module(name, bag)

    def __getitem__(self, name: str) -> PSEmbeddingBag:
        bag = self._modules[name]
        assert isinstance(bag, PSEmbeddingBag)
        return bag

    def __contains__(self, name: str) -> bool:
        return name in self._modules


class PSEmbeddingBagCollection(nn.Module):
    """TorchRec's ``EmbeddingBagCollection`` on shardps tables; see the module docstring.

    ``forward(features)`` returns a ``KeyedTensor`` with one pooled ``[B, dim]`` block per
    feature, in the order of the tables and of their ``feature_names``. A feature missing
    from ``features`` raises KeyError; features the collection does not know are ignored.
    """

    def __init__(self, tables: Sequence[EmbeddingBagConfig], is_weighted: bool = False):
        super().__init__()
        self._tables = list(tables)
        self._is_weighted = is_weighted
        self.embedding_bags = EmbeddingBags()
        seen: dict[str, str] = {}
        for cfg in self._tables:
            if not cfg.feature_names:
                raise InvalidArgument(f"table {cfg.name!r} has no feature_names")
            pooling = PoolingType(cfg.pooling)
            if is_weighted and pooling is not PoolingType.SUM:
                raise InvalidArgument(f"table {cfg.name!r}: weighted features pool with SUM only "
                                      f"(per_sample_weights), not {pooling.name}")
            for f in cfg.feature_names:
                if f in seen:
                    raise InvalidArgument(f"feature {f!r} is in tables {seen[f]!r} and {cfg.name!r}")
                seen[f] = cfg.name
            self.embedding_bags.add(cfg.name, PSEmbeddingBag(
                cfg.num_embeddings, cfg.embedding_dim, mode=pooling.value, optimizer=cfg.optimizer,
                init=cfg.init, num_blocks=cfg.num_blocks))

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return list(self._tables)

    def is_weighted(self) -> bool:
        return self._is_weighted

    def feature_names(self) -> list[str]:
        return [f for cfg in self._tables for f in cfg.feature_names]

    def _table_ids(self, cfg: EmbeddingBagConfig, features: KeyedJaggedTensor) -> torch.Tensor:
        """Every id of the table's features, feature after feature."""
        return torch.cat([features[f].values().reshape(-1) for f in cfg.feature_names])

    def request_prefetch(self, features: KeyedJaggedTensor) -> None:
        """Announce the next forward's features: the owning PSModel fetches every table's
        rows in its next pull (tables whose features are not all in ``features`` are left
        to pull at the forward)."""
        present = set(features.keys())
        for cfg in self._tables:
            if all(f in present for f in cfg.feature_names):
                self.embedding_bags[cfg.name].request_prefetch(self._table_ids(cfg, features))

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        keys, dims, pooled = [], [], []
        for cfg in self._tables:
            bag = self.embedding_bags[cfg.name]
            parts = [features[f] for f in cfg.feature_names]
            ids = self._table_ids(cfg, features)
            rows, inverse = bag._lookup(ids)       # the table's distinct rows, pulled once
            start = 0
            for name, jt in zip(cfg.feature_names, parts):
                n = jt.values().numel()
                weights = jt.weights_or_none() if self._is_weighted else None
                if self._is_weighted and weights is None:
                    raise InvalidArgument(f"feature {name!r}: the collection is weighted; the features have no weights")
                pooled.append(bag.pool(ids[start:start + n], rows, inverse[start:start + n], jt.offsets(),
                                       None if weights is None else weights.to(rows.dtype),
                                       include_last_offset=True))
                keys.append(name)
                dims.append(cfg.embedding_dim)
                start += n
        return KeyedTensor(keys, dims, torch.cat(pooled, dim=1))
