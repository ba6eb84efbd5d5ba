from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    INT64: _ClassVar[DType]

class TableKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TABLE_KIND_UNSPECIFIED: _ClassVar[TableKind]
    DENSE: _ClassVar[TableKind]
    SPARSE: _ClassVar[TableKind]

class OptimizerKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OPTIMIZER_KIND_UNSPECIFIED: _ClassVar[OptimizerKind]
    SGD: _ClassVar[OptimizerKind]
    ADAGRAD: _ClassVar[OptimizerKind]
    ADAM: _ClassVar[OptimizerKind]

class InitKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INIT_KIND_UNSPECIFIED: _ClassVar[InitKind]
    ZEROS: _ClassVar[InitKind]
    CONSTANT: _ClassVar[InitKind]
    UNIFORM: _ClassVar[InitKind]
    NORMAL: _ClassVar[InitKind]
    ASSIGNED: _ClassVar[InitKind]

class ConsistencyMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONSISTENCY_MODE_UNSPECIFIED: _ClassVar[ConsistencyMode]
    ASYNC: _ClassVar[ConsistencyMode]
    SYNC: _ClassVar[ConsistencyMode]
    BOUNDED: _ClassVar[ConsistencyMode]

class ServerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVER_STATE_UNSPECIFIED: _ClassVar[ServerState]
    JOINING: _ClassVar[ServerState]
    SERVING: _ClassVar[ServerState]
    DRAINING: _ClassVar[ServerState]
    DEAD: _ClassVar[ServerState]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
FLOAT64: DType
INT64: DType
TABLE_KIND_UNSPECIFIED: TableKind
DENSE: TableKind
SPARSE: TableKind
OPTIMIZER_KIND_UNSPECIFIED: OptimizerKind
SGD: OptimizerKind
ADAGRAD: OptimizerKind
ADAM: OptimizerKind
INIT_KIND_UNSPECIFIED: InitKind
ZEROS: InitKind
CONSTANT: InitKind
UNIFORM: InitKind
NORMAL: InitKind
ASSIGNED: InitKind
CONSISTENCY_MODE_UNSPECIFIED: ConsistencyMode
ASYNC: ConsistencyMode
SYNC: ConsistencyMode
BOUNDED: ConsistencyMode
SERVER_STATE_UNSPECIFIED: ServerState
JOINING: ServerState
SERVING: ServerState
DRAINING: ServerState
DEAD: ServerState

class OptimizerConfig(_message.Message):
    __slots__ = ("kind", "lr", "momentum", "dampening", "nesterov", "weight_decay", "beta1", "beta2", "eps", "initial_accumulator_value", "lr_decay", "exact_zero_hyperparameters")
    KIND_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    DAMPENING_FIELD_NUMBER: _ClassVar[int]
    NESTEROV_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    INITIAL_ACCUMULATOR_VALUE_FIELD_NUMBER: _ClassVar[int]
    LR_DECAY_FIELD_NUMBER: _ClassVar[int]
    EXACT_ZERO_HYPERPARAMETERS_FIELD_NUMBER: _ClassVar[int]
    kind: OptimizerKind
    lr: float
    momentum: float
    dampening: float
    nesterov: bool
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    initial_accumulator_value: float
    lr_decay: float
    exact_zero_hyperparameters: bool
    def __init__(self, kind: _Optional[_Union[OptimizerKind, str]] = ..., lr: _Optional[float] = ..., momentum: _Optional[float] = ..., dampening: _Optional[float] = ..., nesterov: _Optional[bool] = ..., weight_decay: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., initial_accumulator_value: _Optional[float] = ..., lr_decay: _Optional[float] = ..., exact_zero_hyperparameters: _Optional[bool] = ...) -> None: ...

class Initializer(_message.Message):
    __slots__ = ("kind", "value", "low", "high", "mean", "std", "seed")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    LOW_FIELD_NUMBER: _ClassVar[int]
    HIGH_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    STD_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    kind: InitKind
    value: float
    low: float
    high: float
    mean: float
    std: float
    seed: int
    def __init__(self, kind: _Optional[_Union[InitKind, str]] = ..., value: _Optional[float] = ..., low: _Optional[float] = ..., high: _Optional[float] = ..., mean: _Optional[float] = ..., std: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class TableSpec(_message.Message):
    __slots__ = ("name", "kind", "shape", "dtype", "block_size", "num_blocks", "init")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INIT_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: TableKind
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    block_size: int
    num_blocks: int
    init: Initializer
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[TableKind, str]] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., init: _Optional[_Union[Initializer, _Mapping]] = ...) -> None: ...

class TableConfig(_message.Message):
    __slots__ = ("optimizer", "allow_non_finite", "version", "lifecycle")
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    ALLOW_NON_FINITE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LIFECYCLE_FIELD_NUMBER: _ClassVar[int]
    optimizer: OptimizerConfig
    allow_non_finite: bool
    version: int
    lifecycle: LifecyclePolicy
    def __init__(self, optimizer: _Optional[_Union[OptimizerConfig, _Mapping]] = ..., allow_non_finite: _Optional[bool] = ..., version: _Optional[int] = ..., lifecycle: _Optional[_Union[LifecyclePolicy, _Mapping]] = ...) -> None: ...

class LifecyclePolicy(_message.Message):
    __slots__ = ("budget_bytes", "admit_after", "ttl_steps", "ttl_seconds", "cold")
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADMIT_AFTER_FIELD_NUMBER: _ClassVar[int]
    TTL_STEPS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COLD_FIELD_NUMBER: _ClassVar[int]
    budget_bytes: int
    admit_after: int
    ttl_steps: int
    ttl_seconds: float
    cold: bool
    def __init__(self, budget_bytes: _Optional[int] = ..., admit_after: _Optional[int] = ..., ttl_steps: _Optional[int] = ..., ttl_seconds: _Optional[float] = ..., cold: _Optional[bool] = ...) -> None: ...

class Consistency(_message.Message):
    __slots__ = ("mode", "staleness")
    MODE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    mode: ConsistencyMode
    staleness: int
    def __init__(self, mode: _Optional[_Union[ConsistencyMode, str]] = ..., staleness: _Optional[int] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("name", "address", "incarnation", "state", "metrics_address")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    incarnation: int
    state: ServerState
    metrics_address: str
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., incarnation: _Optional[int] = ..., state: _Optional[_Union[ServerState, str]] = ..., metrics_address: _Optional[str] = ...) -> None: ...

class BlockPlacement(_message.Message):
    __slots__ = ("replicas", "since_epoch", "fresh_epoch", "lost_epoch")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SINCE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    FRESH_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LOST_EPOCH_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedScalarFieldContainer[int]
    since_epoch: int
    fresh_epoch: int
    lost_epoch: int
    def __init__(self, replicas: _Optional[_Iterable[int]] = ..., since_epoch: _Optional[int] = ..., fresh_epoch: _Optional[int] = ..., lost_epoch: _Optional[int] = ...) -> None: ...

class DataLoss(_message.Message):
    __slots__ = ("epoch", "server", "table", "blocks", "lost_at_step", "recovery", "checkpoint", "checkpoint_step", "detail")
    class Recovery(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        LOST: _ClassVar[DataLoss.Recovery]
        RESTORED: _ClassVar[DataLoss.Recovery]
        RESET: _ClassVar[DataLoss.Recovery]
        PENDING: _ClassVar[DataLoss.Recovery]
    LOST: DataLoss.Recovery
    RESTORED: DataLoss.Recovery
    RESET: DataLoss.Recovery
    PENDING: DataLoss.Recovery
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SERVER_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOST_AT_STEP_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    server: str
    table: str
    blocks: _containers.RepeatedScalarFieldContainer[int]
    lost_at_step: int
    recovery: DataLoss.Recovery
    checkpoint: str
    checkpoint_step: int
    detail: str
    def __init__(self, epoch: _Optional[int] = ..., server: _Optional[str] = ..., table: _Optional[str] = ..., blocks: _Optional[_Iterable[int]] = ..., lost_at_step: _Optional[int] = ..., recovery: _Optional[_Union[DataLoss.Recovery, str]] = ..., checkpoint: _Optional[str] = ..., checkpoint_step: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class TablePlacement(_message.Message):
    __slots__ = ("job", "spec", "config", "blocks")
    JOB_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    job: str
    spec: TableSpec
    config: TableConfig
    blocks: _containers.RepeatedCompositeFieldContainer[BlockPlacement]
    def __init__(self, job: _Optional[str] = ..., spec: _Optional[_Union[TableSpec, _Mapping]] = ..., config: _Optional[_Union[TableConfig, _Mapping]] = ..., blocks: _Optional[_Iterable[_Union[BlockPlacement, _Mapping]]] = ...) -> None: ...

class WorkerMember(_message.Message):
    __slots__ = ("rank", "session", "incarnation", "name")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    rank: int
    session: str
    incarnation: int
    name: str
    def __init__(self, rank: _Optional[int] = ..., session: _Optional[str] = ..., incarnation: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class WorkerGroup(_message.Message):
    __slots__ = ("job", "consistency", "members", "membership_version", "quota_bytes", "clients", "data_loss", "peak_members")
    JOB_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_VERSION_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    DATA_LOSS_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    job: str
    consistency: Consistency
    members: _containers.RepeatedCompositeFieldContainer[WorkerMember]
    membership_version: int
    quota_bytes: int
    clients: _containers.RepeatedCompositeFieldContainer[WorkerMember]
    data_loss: _containers.RepeatedCompositeFieldContainer[DataLoss]
    peak_members: int
    def __init__(self, job: _Optional[str] = ..., consistency: _Optional[_Union[Consistency, _Mapping]] = ..., members: _Optional[_Iterable[_Union[WorkerMember, _Mapping]]] = ..., membership_version: _Optional[int] = ..., quota_bytes: _Optional[int] = ..., clients: _Optional[_Iterable[_Union[WorkerMember, _Mapping]]] = ..., data_loss: _Optional[_Iterable[_Union[DataLoss, _Mapping]]] = ..., peak_members: _Optional[int] = ...) -> None: ...

class ShardMap(_message.Message):
    __slots__ = ("epoch", "servers", "tables", "groups", "replication", "changes")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    servers: _containers.RepeatedCompositeFieldContainer[ServerInfo]
    tables: _containers.RepeatedCompositeFieldContainer[TablePlacement]
    groups: _containers.RepeatedCompositeFieldContainer[WorkerGroup]
    replication: int
    changes: ShardMapChanges
    def __init__(self, epoch: _Optional[int] = ..., servers: _Optional[_Iterable[_Union[ServerInfo, _Mapping]]] = ..., tables: _Optional[_Iterable[_Union[TablePlacement, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[WorkerGroup, _Mapping]]] = ..., replication: _Optional[int] = ..., changes: _Optional[_Union[ShardMapChanges, _Mapping]] = ...) -> None: ...

class ShardMapChanges(_message.Message):
    __slots__ = ("from_epoch", "server_names", "servers", "tables", "groups", "removed_groups")
    FROM_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SERVER_NAMES_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    from_epoch: int
    server_names: _containers.RepeatedScalarFieldContainer[str]
    servers: _containers.RepeatedCompositeFieldContainer[ServerInfo]
    tables: _containers.RepeatedCompositeFieldContainer[TableChanges]
    groups: _containers.RepeatedCompositeFieldContainer[WorkerGroup]
    removed_groups: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, from_epoch: _Optional[int] = ..., server_names: _Optional[_Iterable[str]] = ..., servers: _Optional[_Iterable[_Union[ServerInfo, _Mapping]]] = ..., tables: _Optional[_Iterable[_Union[TableChanges, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[WorkerGroup, _Mapping]]] = ..., removed_groups: _Optional[_Iterable[str]] = ...) -> None: ...

class TableChanges(_message.Message):
    __slots__ = ("job", "table", "removed", "whole", "block_indexes", "blocks")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    WHOLE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEXES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    job: str
    table: str
    removed: bool
    whole: TablePlacement
    block_indexes: _containers.RepeatedScalarFieldContainer[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockPlacement]
    def __init__(self, job: _Optional[str] = ..., table: _Optional[str] = ..., removed: _Optional[bool] = ..., whole: _Optional[_Union[TablePlacement, _Mapping]] = ..., block_indexes: _Optional[_Iterable[int]] = ..., blocks: _Optional[_Iterable[_Union[BlockPlacement, _Mapping]]] = ...) -> None: ...

class RequestHeader(_message.Message):
    __slots__ = ("job", "epoch", "session", "incarnation", "sequence", "acked_below", "clock", "wire_dtype")
    JOB_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ACKED_BELOW_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    job: str
    epoch: int
    session: str
    incarnation: int
    sequence: int
    acked_below: int
    clock: int
    wire_dtype: DType
    def __init__(self, job: _Optional[str] = ..., epoch: _Optional[int] = ..., session: _Optional[str] = ..., incarnation: _Optional[int] = ..., sequence: _Optional[int] = ..., acked_below: _Optional[int] = ..., clock: _Optional[int] = ..., wire_dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class BlockVersion(_message.Message):
    __slots__ = ("table", "block", "version")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    table: str
    block: int
    version: int
    def __init__(self, table: _Optional[str] = ..., block: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class Range(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class RowSelection(_message.Message):
    __slots__ = ("count", "all_stored")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    ALL_STORED_FIELD_NUMBER: _ClassVar[int]
    count: int
    all_stored: bool
    def __init__(self, count: _Optional[int] = ..., all_stored: _Optional[bool] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("table", "range", "rows", "base_versions")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    table: str
    range: Range
    rows: RowSelection
    base_versions: _containers.RepeatedCompositeFieldContainer[BlockVersion]
    def __init__(self, table: _Optional[str] = ..., range: _Optional[_Union[Range, _Mapping]] = ..., rows: _Optional[_Union[RowSelection, _Mapping]] = ..., base_versions: _Optional[_Iterable[_Union[BlockVersion, _Mapping]]] = ...) -> None: ...

class SharedMemoryRef(_message.Message):
    __slots__ = ("name", "offset", "length")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    length: int
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...
