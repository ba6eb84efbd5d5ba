"""Conversions between shardps's plain dataclasses and the ``shardps.v1`` protobuf messages.

The only place that knows both vocabularies' field names. Unknown enum values and malformed
fields raise ``InvalidArgument`` naming the field.
"""

from __future__ import annotations

from shardps.dtypes import WireDType
from shardps.errors import InvalidArgument
from shardps.protos.v1 import common_pb2 as pb
from shardps.tables import (
    Consistency,
    Initializer,
    InitKind,
    LifecyclePolicy,
    OptimizerConfig,
    OptimizerKind,
    TableConfig,
    TableKind,
    TableSpec,
)

# The ``# type: ignore[arg-type]`` below: protobuf's stubs type an enum field as its enum's
# ValueType; our enums' ``.value`` is the same number as a plain int.


def _enum(cls, value: int, field: str, default=None):
    """Enum member for a proto enum number; 0 (unset) gives ``default``."""
    if value == 0:
        return default
    try:
        return cls(value)
    except ValueError:
        raise InvalidArgument(f"{field}={value}: unknown value") from None


def optimizer_to_proto(cfg: OptimizerConfig) -> pb.OptimizerConfig:
    return pb.OptimizerConfig(
        kind=cfg.kind.value, lr=cfg.lr, momentum=cfg.momentum, dampening=cfg.dampening,  # type: ignore[arg-type]
        nesterov=cfg.nesterov, weight_decay=cfg.weight_decay, beta1=cfg.beta1, beta2=cfg.beta2,
        eps=cfg.effective_eps, initial_accumulator_value=cfg.initial_accumulator_value,
        lr_decay=cfg.lr_decay, exact_zero_hyperparameters=True)


def optimizer_from_proto(msg: pb.OptimizerConfig) -> OptimizerConfig:
    kind = _enum(OptimizerKind, msg.kind, "optimizer.kind")
    if kind is None:
        raise InvalidArgument("optimizer.kind is unset: choose SGD, ADAGRAD or ADAM")
    exact = msg.exact_zero_hyperparameters
    return OptimizerConfig(
        kind=kind, lr=msg.lr, momentum=msg.momentum, dampening=msg.dampening,
        nesterov=msg.nesterov, weight_decay=msg.weight_decay,
        beta1=msg.beta1 if (exact or msg.beta1) else 0.9,
        beta2=msg.beta2 if (exact or msg.beta2) else 0.999,
        eps=msg.eps if (exact or msg.eps) else None,
        initial_accumulator_value=msg.initial_accumulator_value, lr_decay=msg.lr_decay)


def lifecycle_to_proto(p: LifecyclePolicy) -> pb.LifecyclePolicy:
    return pb.LifecyclePolicy(budget_bytes=p.budget_bytes, admit_after=p.admit_after,
                              ttl_steps=p.ttl_steps, ttl_seconds=p.ttl_seconds, cold=p.cold)


def lifecycle_from_proto(msg: pb.LifecyclePolicy) -> LifecyclePolicy:
    return LifecyclePolicy(budget_bytes=int(msg.budget_bytes), admit_after=int(msg.admit_after),
                           ttl_steps=int(msg.ttl_steps), ttl_seconds=float(msg.ttl_seconds), cold=bool(msg.cold))


def config_to_proto(cfg: TableConfig) -> pb.TableConfig:
    return pb.TableConfig(optimizer=optimizer_to_proto(cfg.optimizer),
                          allow_non_finite=cfg.allow_non_finite, version=cfg.version,
                          lifecycle=lifecycle_to_proto(cfg.lifecycle))


def config_from_proto(msg: pb.TableConfig) -> TableConfig:
    return TableConfig(optimizer=optimizer_from_proto(msg.optimizer),
                       allow_non_finite=msg.allow_non_finite, version=msg.version,
                       lifecycle=lifecycle_from_proto(msg.lifecycle))


def init_to_proto(init: Initializer) -> pb.Initializer:
    return pb.Initializer(kind=init.kind.value, value=init.value, low=init.low, high=init.high,  # type: ignore[arg-type]
                          mean=init.mean, std=init.std, seed=init.seed)


def init_from_proto(msg: pb.Initializer) -> Initializer:
    return Initializer(kind=_enum(InitKind, msg.kind, "init.kind", InitKind.ZEROS),
                       value=msg.value, low=msg.low, high=msg.high, mean=msg.mean, std=msg.std,
                       seed=msg.seed)


def spec_to_proto(spec: TableSpec) -> pb.TableSpec:
    return pb.TableSpec(name=spec.name, kind=spec.kind.value, shape=list(spec.shape),  # type: ignore[arg-type]
                        dtype=pb.FLOAT32, block_size=spec.block_size, num_blocks=spec.num_blocks,
                        init=init_to_proto(spec.init))


def spec_from_proto(msg: pb.TableSpec) -> TableSpec:
    kind = _enum(TableKind, msg.kind, "spec.kind")
    if kind is None:
        raise InvalidArgument(f"table {msg.name!r}: spec.kind is unset: choose DENSE or SPARSE")
    if msg.dtype not in (pb.DTYPE_UNSPECIFIED, pb.FLOAT32):
        raise InvalidArgument(f"table {msg.name!r}: storage dtype {msg.dtype} unsupported; use FLOAT32")
    return TableSpec(name=msg.name, kind=kind, shape=tuple(msg.shape),
                     init=init_from_proto(msg.init), block_size=msg.block_size,
                     num_blocks=msg.num_blocks)


def consistency_to_proto(mode: Consistency, staleness: int = 0) -> pb.Consistency:
    return pb.Consistency(mode=mode.value, staleness=staleness)  # type: ignore[arg-type]


def consistency_from_proto(msg: pb.Consistency) -> tuple[Consistency, int]:
    return _enum(Consistency, msg.mode, "consistency.mode", Consistency.ASYNC), int(msg.staleness)


def wire_dtype_from_proto(value: int) -> WireDType:
    return WireDType.parse(int(value))
