from shardps.protos.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterServerRequest(_message.Message):
    __slots__ = ("name", "address", "metrics_address", "boot_id", "accepts_map_changes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_MAP_CHANGES_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    metrics_address: str
    boot_id: str
    accepts_map_changes: bool
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., metrics_address: _Optional[str] = ..., boot_id: _Optional[str] = ..., accepts_map_changes: _Optional[bool] = ...) -> None: ...

class RegisterServerResponse(_message.Message):
    __slots__ = ("incarnation", "lease_seconds", "heartbeat_seconds", "map", "token_key")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAP_FIELD_NUMBER: _ClassVar[int]
    TOKEN_KEY_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    lease_seconds: float
    heartbeat_seconds: float
    map: _common_pb2.ShardMap
    token_key: bytes
    def __init__(self, incarnation: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., heartbeat_seconds: _Optional[float] = ..., map: _Optional[_Union[_common_pb2.ShardMap, _Mapping]] = ..., token_key: _Optional[bytes] = ...) -> None: ...

class ServerHeartbeatRequest(_message.Message):
    __slots__ = ("name", "incarnation", "epoch", "primary_blocks", "replica_blocks", "bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    incarnation: int
    epoch: int
    primary_blocks: int
    replica_blocks: int
    bytes: int
    def __init__(self, name: _Optional[str] = ..., incarnation: _Optional[int] = ..., epoch: _Optional[int] = ..., primary_blocks: _Optional[int] = ..., replica_blocks: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class ServerHeartbeatResponse(_message.Message):
    __slots__ = ("epoch", "retired", "token_floors")
    class TokenFloorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RETIRED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FLOORS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    retired: bool
    token_floors: _containers.ScalarMap[str, int]
    def __init__(self, epoch: _Optional[int] = ..., retired: _Optional[bool] = ..., token_floors: _Optional[_Mapping[str, int]] = ...) -> None: ...

class DrainServerRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DrainServerResponse(_message.Message):
    __slots__ = ("epoch", "blocks_to_move")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_MOVE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    blocks_to_move: int
    def __init__(self, epoch: _Optional[int] = ..., blocks_to_move: _Optional[int] = ...) -> None: ...

class JobQuota(_message.Message):
    __slots__ = ("max_bytes",)
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_bytes: int
    def __init__(self, max_bytes: _Optional[int] = ...) -> None: ...

class CreateJobRequest(_message.Message):
    __slots__ = ("job", "consistency", "quota", "token_ttl_seconds")
    JOB_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_FIELD_NUMBER: _ClassVar[int]
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job: str
    consistency: _common_pb2.Consistency
    quota: JobQuota
    token_ttl_seconds: float
    def __init__(self, job: _Optional[str] = ..., consistency: _Optional[_Union[_common_pb2.Consistency, _Mapping]] = ..., quota: _Optional[_Union[JobQuota, _Mapping]] = ..., token_ttl_seconds: _Optional[float] = ...) -> None: ...

class CreateJobResponse(_message.Message):
    __slots__ = ("token", "created", "token_expires_at", "step")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    token: str
    created: bool
    token_expires_at: float
    step: int
    def __init__(self, token: _Optional[str] = ..., created: _Optional[bool] = ..., token_expires_at: _Optional[float] = ..., step: _Optional[int] = ...) -> None: ...

class RevokeJobTokensRequest(_message.Message):
    __slots__ = ("job", "token_ttl_seconds")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job: str
    token_ttl_seconds: float
    def __init__(self, job: _Optional[str] = ..., token_ttl_seconds: _Optional[float] = ...) -> None: ...

class RevokeJobTokensResponse(_message.Message):
    __slots__ = ("generation", "token", "token_expires_at")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    generation: int
    token: str
    token_expires_at: float
    def __init__(self, generation: _Optional[int] = ..., token: _Optional[str] = ..., token_expires_at: _Optional[float] = ...) -> None: ...

class EndJobRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class EndJobResponse(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class CreateTableRequest(_message.Message):
    __slots__ = ("job", "spec", "config")
    JOB_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    job: str
    spec: _common_pb2.TableSpec
    config: _common_pb2.TableConfig
    def __init__(self, job: _Optional[str] = ..., spec: _Optional[_Union[_common_pb2.TableSpec, _Mapping]] = ..., config: _Optional[_Union[_common_pb2.TableConfig, _Mapping]] = ...) -> None: ...

class CreateTableResponse(_message.Message):
    __slots__ = ("table", "created", "epoch")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    table: _common_pb2.TablePlacement
    created: bool
    epoch: int
    def __init__(self, table: _Optional[_Union[_common_pb2.TablePlacement, _Mapping]] = ..., created: _Optional[bool] = ..., epoch: _Optional[int] = ...) -> None: ...

class TableDefinition(_message.Message):
    __slots__ = ("spec", "config")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    spec: _common_pb2.TableSpec
    config: _common_pb2.TableConfig
    def __init__(self, spec: _Optional[_Union[_common_pb2.TableSpec, _Mapping]] = ..., config: _Optional[_Union[_common_pb2.TableConfig, _Mapping]] = ...) -> None: ...

class CreateTablesRequest(_message.Message):
    __slots__ = ("job", "tables")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    job: str
    tables: _containers.RepeatedCompositeFieldContainer[TableDefinition]
    def __init__(self, job: _Optional[str] = ..., tables: _Optional[_Iterable[_Union[TableDefinition, _Mapping]]] = ...) -> None: ...

class CreateTablesResponse(_message.Message):
    __slots__ = ("tables", "created", "epoch")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[_common_pb2.TablePlacement]
    created: _containers.RepeatedScalarFieldContainer[bool]
    epoch: int
    def __init__(self, tables: _Optional[_Iterable[_Union[_common_pb2.TablePlacement, _Mapping]]] = ..., created: _Optional[_Iterable[bool]] = ..., epoch: _Optional[int] = ...) -> None: ...

class DescribeTableRequest(_message.Message):
    __slots__ = ("job", "table")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    job: str
    table: str
    def __init__(self, job: _Optional[str] = ..., table: _Optional[str] = ...) -> None: ...

class ListTablesRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class ListTablesResponse(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[_common_pb2.TablePlacement]
    def __init__(self, tables: _Optional[_Iterable[_Union[_common_pb2.TablePlacement, _Mapping]]] = ...) -> None: ...

class UpdateTableConfigRequest(_message.Message):
    __slots__ = ("job", "table", "config", "expected_version")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    job: str
    table: str
    config: _common_pb2.TableConfig
    expected_version: int
    def __init__(self, job: _Optional[str] = ..., table: _Optional[str] = ..., config: _Optional[_Union[_common_pb2.TableConfig, _Mapping]] = ..., expected_version: _Optional[int] = ...) -> None: ...

class TableConfigChange(_message.Message):
    __slots__ = ("table", "config", "expected_version")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    table: str
    config: _common_pb2.TableConfig
    expected_version: int
    def __init__(self, table: _Optional[str] = ..., config: _Optional[_Union[_common_pb2.TableConfig, _Mapping]] = ..., expected_version: _Optional[int] = ...) -> None: ...

class UpdateTableConfigsRequest(_message.Message):
    __slots__ = ("job", "changes")
    JOB_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    job: str
    changes: _containers.RepeatedCompositeFieldContainer[TableConfigChange]
    def __init__(self, job: _Optional[str] = ..., changes: _Optional[_Iterable[_Union[TableConfigChange, _Mapping]]] = ...) -> None: ...

class UpdateTableConfigsResponse(_message.Message):
    __slots__ = ("configs",)
    CONFIGS_FIELD_NUMBER: _ClassVar[int]
    configs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TableConfig]
    def __init__(self, configs: _Optional[_Iterable[_Union[_common_pb2.TableConfig, _Mapping]]] = ...) -> None: ...

class DeleteTableRequest(_message.Message):
    __slots__ = ("job", "table")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    job: str
    table: str
    def __init__(self, job: _Optional[str] = ..., table: _Optional[str] = ...) -> None: ...

class DeleteTableResponse(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class GetShardMapRequest(_message.Message):
    __slots__ = ("min_epoch", "known_epoch", "job")
    MIN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    KNOWN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    min_epoch: int
    known_epoch: int
    job: str
    def __init__(self, min_epoch: _Optional[int] = ..., known_epoch: _Optional[int] = ..., job: _Optional[str] = ...) -> None: ...

class WatchShardMapRequest(_message.Message):
    __slots__ = ("after_epoch", "changes", "job")
    AFTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    after_epoch: int
    changes: bool
    job: str
    def __init__(self, after_epoch: _Optional[int] = ..., changes: _Optional[bool] = ..., job: _Optional[str] = ...) -> None: ...

class JoinWorkerGroupRequest(_message.Message):
    __slots__ = ("job", "name", "rank_hint", "previous_session", "consistency", "client")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_HINT_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_SESSION_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    job: str
    name: str
    rank_hint: int
    previous_session: str
    consistency: _common_pb2.Consistency
    client: bool
    def __init__(self, job: _Optional[str] = ..., name: _Optional[str] = ..., rank_hint: _Optional[int] = ..., previous_session: _Optional[str] = ..., consistency: _Optional[_Union[_common_pb2.Consistency, _Mapping]] = ..., client: _Optional[bool] = ...) -> None: ...

class JoinWorkerGroupResponse(_message.Message):
    __slots__ = ("rank", "session", "incarnation", "group", "epoch", "lease_seconds", "heartbeat_seconds", "restored", "step")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    rank: int
    session: str
    incarnation: int
    group: _common_pb2.WorkerGroup
    epoch: int
    lease_seconds: float
    heartbeat_seconds: float
    restored: bool
    step: int
    def __init__(self, rank: _Optional[int] = ..., session: _Optional[str] = ..., incarnation: _Optional[int] = ..., group: _Optional[_Union[_common_pb2.WorkerGroup, _Mapping]] = ..., epoch: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., heartbeat_seconds: _Optional[float] = ..., restored: _Optional[bool] = ..., step: _Optional[int] = ...) -> None: ...

class LeaveWorkerGroupRequest(_message.Message):
    __slots__ = ("job", "session", "step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job: str
    session: str
    step: int
    def __init__(self, job: _Optional[str] = ..., session: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class LeaveWorkerGroupResponse(_message.Message):
    __slots__ = ("membership_version",)
    MEMBERSHIP_VERSION_FIELD_NUMBER: _ClassVar[int]
    membership_version: int
    def __init__(self, membership_version: _Optional[int] = ...) -> None: ...

class WorkerHeartbeatRequest(_message.Message):
    __slots__ = ("job", "session", "incarnation", "step", "samples_per_second", "loss")
    JOB_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    job: str
    session: str
    incarnation: int
    step: int
    samples_per_second: float
    loss: float
    def __init__(self, job: _Optional[str] = ..., session: _Optional[str] = ..., incarnation: _Optional[int] = ..., step: _Optional[int] = ..., samples_per_second: _Optional[float] = ..., loss: _Optional[float] = ...) -> None: ...

class WorkerHeartbeatResponse(_message.Message):
    __slots__ = ("membership_version", "world_size", "rank", "checkpoint_step", "epoch", "checkpoint_id")
    MEMBERSHIP_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    membership_version: int
    world_size: int
    rank: int
    checkpoint_step: int
    epoch: int
    checkpoint_id: str
    def __init__(self, membership_version: _Optional[int] = ..., world_size: _Optional[int] = ..., rank: _Optional[int] = ..., checkpoint_step: _Optional[int] = ..., epoch: _Optional[int] = ..., checkpoint_id: _Optional[str] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("job", "directory")
    JOB_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    job: str
    directory: str
    def __init__(self, job: _Optional[str] = ..., directory: _Optional[str] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("path", "step", "tables", "bytes")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    tables: int
    bytes: int
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ..., tables: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class CheckpointBarrierRequest(_message.Message):
    __slots__ = ("job", "session", "step", "worker_state", "checkpoint_id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORKER_STATE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    session: str
    step: int
    worker_state: bytes
    checkpoint_id: str
    def __init__(self, job: _Optional[str] = ..., session: _Optional[str] = ..., step: _Optional[int] = ..., worker_state: _Optional[bytes] = ..., checkpoint_id: _Optional[str] = ...) -> None: ...

class CheckpointBarrierResponse(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("job", "path")
    JOB_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    job: str
    path: str
    def __init__(self, job: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("epoch", "step", "tables")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step: int
    tables: int
    def __init__(self, epoch: _Optional[int] = ..., step: _Optional[int] = ..., tables: _Optional[int] = ...) -> None: ...

class ResetLostBlocksRequest(_message.Message):
    __slots__ = ("job", "table")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    job: str
    table: str
    def __init__(self, job: _Optional[str] = ..., table: _Optional[str] = ...) -> None: ...

class ResetLostBlocksResponse(_message.Message):
    __slots__ = ("epoch", "blocks")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    blocks: int
    def __init__(self, epoch: _Optional[int] = ..., blocks: _Optional[int] = ...) -> None: ...

class GetWorkerStateRequest(_message.Message):
    __slots__ = ("job", "rank", "latest")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    latest: bool
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., latest: _Optional[bool] = ...) -> None: ...

class GetWorkerStateResponse(_message.Message):
    __slots__ = ("worker_state", "step")
    WORKER_STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    worker_state: bytes
    step: int
    def __init__(self, worker_state: _Optional[bytes] = ..., step: _Optional[int] = ...) -> None: ...

class GetClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerStatus(_message.Message):
    __slots__ = ("server", "primary_blocks", "replica_blocks", "bytes", "heartbeat_age_seconds")
    SERVER_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    server: _common_pb2.ServerInfo
    primary_blocks: int
    replica_blocks: int
    bytes: int
    heartbeat_age_seconds: float
    def __init__(self, server: _Optional[_Union[_common_pb2.ServerInfo, _Mapping]] = ..., primary_blocks: _Optional[int] = ..., replica_blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., heartbeat_age_seconds: _Optional[float] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("member", "step", "samples_per_second", "loss", "heartbeat_age_seconds")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    member: _common_pb2.WorkerMember
    step: int
    samples_per_second: float
    loss: float
    heartbeat_age_seconds: float
    def __init__(self, member: _Optional[_Union[_common_pb2.WorkerMember, _Mapping]] = ..., step: _Optional[int] = ..., samples_per_second: _Optional[float] = ..., loss: _Optional[float] = ..., heartbeat_age_seconds: _Optional[float] = ...) -> None: ...

class GroupStatus(_message.Message):
    __slots__ = ("job", "consistency", "workers", "tables", "data_loss")
    JOB_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    DATA_LOSS_FIELD_NUMBER: _ClassVar[int]
    job: str
    consistency: _common_pb2.Consistency
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    tables: int
    data_loss: _containers.RepeatedCompositeFieldContainer[_common_pb2.DataLoss]
    def __init__(self, job: _Optional[str] = ..., consistency: _Optional[_Union[_common_pb2.Consistency, _Mapping]] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., tables: _Optional[int] = ..., data_loss: _Optional[_Iterable[_Union[_common_pb2.DataLoss, _Mapping]]] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("epoch", "replication", "servers", "groups", "blocks", "under_replicated_blocks", "pending_moves", "lost_blocks")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    UNDER_REPLICATED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PENDING_MOVES_FIELD_NUMBER: _ClassVar[int]
    LOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    replication: int
    servers: _containers.RepeatedCompositeFieldContainer[ServerStatus]
    groups: _containers.RepeatedCompositeFieldContainer[GroupStatus]
    blocks: int
    under_replicated_blocks: int
    pending_moves: int
    lost_blocks: int
    def __init__(self, epoch: _Optional[int] = ..., replication: _Optional[int] = ..., servers: _Optional[_Iterable[_Union[ServerStatus, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[GroupStatus, _Mapping]]] = ..., blocks: _Optional[int] = ..., under_replicated_blocks: _Optional[int] = ..., pending_moves: _Optional[int] = ..., lost_blocks: _Optional[int] = ...) -> None: ...
