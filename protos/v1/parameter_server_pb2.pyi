from shardps.protos.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PushKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUSH_KIND_UNSPECIFIED: _ClassVar[PushKind]
    GRADIENT: _ClassVar[PushKind]
    INITIALIZE: _ClassVar[PushKind]
    ASSIGN: _ClassVar[PushKind]

class BlockOpKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCK_OP_KIND_UNSPECIFIED: _ClassVar[BlockOpKind]
    APPLY: _ClassVar[BlockOpKind]
    INITIAL: _ClassVar[BlockOpKind]
    ACCUMULATE: _ClassVar[BlockOpKind]
    APPLY_STEP: _ClassVar[BlockOpKind]
    ASSIGN_VALUES: _ClassVar[BlockOpKind]
    APPLY_ROWS: _ClassVar[BlockOpKind]

class BlockRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCK_ROLE_UNSPECIFIED: _ClassVar[BlockRole]
    BLOCK_PRIMARY: _ClassVar[BlockRole]
    BLOCK_BACKUP: _ClassVar[BlockRole]
PUSH_KIND_UNSPECIFIED: PushKind
GRADIENT: PushKind
INITIALIZE: PushKind
ASSIGN: PushKind
BLOCK_OP_KIND_UNSPECIFIED: BlockOpKind
APPLY: BlockOpKind
INITIAL: BlockOpKind
ACCUMULATE: BlockOpKind
APPLY_STEP: BlockOpKind
ASSIGN_VALUES: BlockOpKind
APPLY_ROWS: BlockOpKind
BLOCK_ROLE_UNSPECIFIED: BlockRole
BLOCK_PRIMARY: BlockRole
BLOCK_BACKUP: BlockRole

class PushHeader(_message.Message):
    __slots__ = ("header", "kind", "segments", "payload_bytes", "shared_memory")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    kind: PushKind
    segments: _containers.RepeatedCompositeFieldContainer[_common_pb2.Segment]
    payload_bytes: int
    shared_memory: _common_pb2.SharedMemoryRef
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., kind: _Optional[_Union[PushKind, str]] = ..., segments: _Optional[_Iterable[_Union[_common_pb2.Segment, _Mapping]]] = ..., payload_bytes: _Optional[int] = ..., shared_memory: _Optional[_Union[_common_pb2.SharedMemoryRef, _Mapping]] = ...) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushAck(_message.Message):
    __slots__ = ("versions", "duplicate_blocks")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockVersion]
    duplicate_blocks: int
    def __init__(self, versions: _Optional[_Iterable[_Union[_common_pb2.BlockVersion, _Mapping]]] = ..., duplicate_blocks: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("header", "segments", "data", "reply_shared_memory", "chunk_bytes")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    REPLY_SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    segments: _containers.RepeatedCompositeFieldContainer[_common_pb2.Segment]
    data: bytes
    reply_shared_memory: _common_pb2.SharedMemoryRef
    chunk_bytes: int
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., segments: _Optional[_Iterable[_Union[_common_pb2.Segment, _Mapping]]] = ..., data: _Optional[bytes] = ..., reply_shared_memory: _Optional[_Union[_common_pb2.SharedMemoryRef, _Mapping]] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class SegmentLayout(_message.Message):
    __slots__ = ("dtype", "elements", "ids")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    dtype: _common_pb2.DType
    elements: int
    ids: int
    def __init__(self, dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., elements: _Optional[int] = ..., ids: _Optional[int] = ...) -> None: ...

class PullHeader(_message.Message):
    __slots__ = ("versions", "segments", "payload_bytes", "min_clock", "in_shared_memory", "waited_seconds")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    MIN_CLOCK_FIELD_NUMBER: _ClassVar[int]
    IN_SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    WAITED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockVersion]
    segments: _containers.RepeatedCompositeFieldContainer[SegmentLayout]
    payload_bytes: int
    min_clock: int
    in_shared_memory: bool
    waited_seconds: float
    def __init__(self, versions: _Optional[_Iterable[_Union[_common_pb2.BlockVersion, _Mapping]]] = ..., segments: _Optional[_Iterable[_Union[SegmentLayout, _Mapping]]] = ..., payload_bytes: _Optional[int] = ..., min_clock: _Optional[int] = ..., in_shared_memory: _Optional[bool] = ..., waited_seconds: _Optional[float] = ...) -> None: ...

class PullChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PullHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PullHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ProbeSharedMemoryRequest(_message.Message):
    __slots__ = ("ref", "nonce", "job")
    REF_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    ref: _common_pb2.SharedMemoryRef
    nonce: bytes
    job: str
    def __init__(self, ref: _Optional[_Union[_common_pb2.SharedMemoryRef, _Mapping]] = ..., nonce: _Optional[bytes] = ..., job: _Optional[str] = ...) -> None: ...

class ProbeSharedMemoryResponse(_message.Message):
    __slots__ = ("usable", "reason")
    USABLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    usable: bool
    reason: str
    def __init__(self, usable: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class WriterId(_message.Message):
    __slots__ = ("session", "incarnation", "sequence", "acked_below")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ACKED_BELOW_FIELD_NUMBER: _ClassVar[int]
    session: str
    incarnation: int
    sequence: int
    acked_below: int
    def __init__(self, session: _Optional[str] = ..., incarnation: _Optional[int] = ..., sequence: _Optional[int] = ..., acked_below: _Optional[int] = ...) -> None: ...

class BlockOp(_message.Message):
    __slots__ = ("job", "table", "block", "kind", "writer", "version", "config_version", "step", "divisor", "id_count", "element_count", "range", "dropped_count", "evicted_count", "blocks", "versions", "same_step", "cooled_count")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    WRITER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CONFIG_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DIVISOR_FIELD_NUMBER: _ClassVar[int]
    ID_COUNT_FIELD_NUMBER: _ClassVar[int]
    ELEMENT_COUNT_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    DROPPED_COUNT_FIELD_NUMBER: _ClassVar[int]
    EVICTED_COUNT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    SAME_STEP_FIELD_NUMBER: _ClassVar[int]
    COOLED_COUNT_FIELD_NUMBER: _ClassVar[int]
    job: str
    table: str
    block: int
    kind: BlockOpKind
    writer: WriterId
    version: int
    config_version: int
    step: int
    divisor: int
    id_count: int
    element_count: int
    range: _common_pb2.Range
    dropped_count: int
    evicted_count: int
    blocks: _containers.RepeatedScalarFieldContainer[int]
    versions: _containers.RepeatedScalarFieldContainer[int]
    same_step: bool
    cooled_count: int
    def __init__(self, job: _Optional[str] = ..., table: _Optional[str] = ..., block: _Optional[int] = ..., kind: _Optional[_Union[BlockOpKind, str]] = ..., writer: _Optional[_Union[WriterId, _Mapping]] = ..., version: _Optional[int] = ..., config_version: _Optional[int] = ..., step: _Optional[int] = ..., divisor: _Optional[int] = ..., id_count: _Optional[int] = ..., element_count: _Optional[int] = ..., range: _Optional[_Union[_common_pb2.Range, _Mapping]] = ..., dropped_count: _Optional[int] = ..., evicted_count: _Optional[int] = ..., blocks: _Optional[_Iterable[int]] = ..., versions: _Optional[_Iterable[int]] = ..., same_step: _Optional[bool] = ..., cooled_count: _Optional[int] = ...) -> None: ...

class ReplicateHeader(_message.Message):
    __slots__ = ("epoch", "source", "ops", "payload_bytes")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    source: str
    ops: _containers.RepeatedCompositeFieldContainer[BlockOp]
    payload_bytes: int
    def __init__(self, epoch: _Optional[int] = ..., source: _Optional[str] = ..., ops: _Optional[_Iterable[_Union[BlockOp, _Mapping]]] = ..., payload_bytes: _Optional[int] = ...) -> None: ...

class ReplicateChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ReplicateHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ReplicateHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReplicateAck(_message.Message):
    __slots__ = ("applied", "out_of_sync")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    OUT_OF_SYNC_FIELD_NUMBER: _ClassVar[int]
    applied: int
    out_of_sync: _containers.RepeatedCompositeFieldContainer[BlockRef]
    def __init__(self, applied: _Optional[int] = ..., out_of_sync: _Optional[_Iterable[_Union[BlockRef, _Mapping]]] = ...) -> None: ...

class InstallShardMapRequest(_message.Message):
    __slots__ = ("map",)
    MAP_FIELD_NUMBER: _ClassVar[int]
    map: _common_pb2.ShardMap
    def __init__(self, map: _Optional[_Union[_common_pb2.ShardMap, _Mapping]] = ...) -> None: ...

class InstallShardMapResponse(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class BlockRef(_message.Message):
    __slots__ = ("job", "table", "block")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    job: str
    table: str
    block: int
    def __init__(self, job: _Optional[str] = ..., table: _Optional[str] = ..., block: _Optional[int] = ...) -> None: ...

class CopyBlocksRequest(_message.Message):
    __slots__ = ("epoch", "blocks", "destination")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    blocks: _containers.RepeatedCompositeFieldContainer[BlockRef]
    destination: str
    def __init__(self, epoch: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[BlockRef, _Mapping]]] = ..., destination: _Optional[str] = ...) -> None: ...

class CopyBlocksResponse(_message.Message):
    __slots__ = ("copied", "bytes")
    COPIED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    copied: int
    bytes: int
    def __init__(self, copied: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class BlockStateHeader(_message.Message):
    __slots__ = ("ref", "version", "initialized", "arrays", "metadata")
    REF_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    ARRAYS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    ref: BlockRef
    version: int
    initialized: bool
    arrays: _containers.RepeatedCompositeFieldContainer[ArrayInfo]
    metadata: bytes
    def __init__(self, ref: _Optional[_Union[BlockRef, _Mapping]] = ..., version: _Optional[int] = ..., initialized: _Optional[bool] = ..., arrays: _Optional[_Iterable[_Union[ArrayInfo, _Mapping]]] = ..., metadata: _Optional[bytes] = ...) -> None: ...

class ArrayInfo(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: _common_pb2.DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockChunk(_message.Message):
    __slots__ = ("header", "data", "epoch")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    header: BlockStateHeader
    data: bytes
    epoch: int
    def __init__(self, header: _Optional[_Union[BlockStateHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., epoch: _Optional[int] = ...) -> None: ...

class LoadBlocksResponse(_message.Message):
    __slots__ = ("loaded",)
    LOADED_FIELD_NUMBER: _ClassVar[int]
    loaded: int
    def __init__(self, loaded: _Optional[int] = ...) -> None: ...

class SnapshotBlocksRequest(_message.Message):
    __slots__ = ("epoch", "blocks")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    blocks: _containers.RepeatedCompositeFieldContainer[BlockRef]
    def __init__(self, epoch: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[BlockRef, _Mapping]]] = ...) -> None: ...

class HoldJobRequest(_message.Message):
    __slots__ = ("job", "hold", "hold_seconds")
    JOB_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    HOLD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job: str
    hold: bool
    hold_seconds: float
    def __init__(self, job: _Optional[str] = ..., hold: _Optional[bool] = ..., hold_seconds: _Optional[float] = ...) -> None: ...

class HoldJobResponse(_message.Message):
    __slots__ = ("in_flight",)
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    in_flight: int
    def __init__(self, in_flight: _Optional[int] = ...) -> None: ...

class DropTablesRequest(_message.Message):
    __slots__ = ("job", "tables")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    job: str
    tables: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job: _Optional[str] = ..., tables: _Optional[_Iterable[str]] = ...) -> None: ...

class DropTablesResponse(_message.Message):
    __slots__ = ("dropped_blocks",)
    DROPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    dropped_blocks: int
    def __init__(self, dropped_blocks: _Optional[int] = ...) -> None: ...

class GetNodeStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TableUsage(_message.Message):
    __slots__ = ("job", "table", "blocks", "parameters", "bytes", "budget_bytes", "rows", "rows_admitted", "rows_evicted_ttl", "rows_evicted_budget", "rows_not_admitted", "rows_cooled", "cold_rows", "cold_bytes")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ROWS_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    ROWS_EVICTED_TTL_FIELD_NUMBER: _ClassVar[int]
    ROWS_EVICTED_BUDGET_FIELD_NUMBER: _ClassVar[int]
    ROWS_NOT_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    ROWS_COOLED_FIELD_NUMBER: _ClassVar[int]
    COLD_ROWS_FIELD_NUMBER: _ClassVar[int]
    COLD_BYTES_FIELD_NUMBER: _ClassVar[int]
    job: str
    table: str
    blocks: int
    parameters: int
    bytes: int
    budget_bytes: int
    rows: int
    rows_admitted: int
    rows_evicted_ttl: int
    rows_evicted_budget: int
    rows_not_admitted: int
    rows_cooled: int
    cold_rows: int
    cold_bytes: int
    def __init__(self, job: _Optional[str] = ..., table: _Optional[str] = ..., blocks: _Optional[int] = ..., parameters: _Optional[int] = ..., bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., rows: _Optional[int] = ..., rows_admitted: _Optional[int] = ..., rows_evicted_ttl: _Optional[int] = ..., rows_evicted_budget: _Optional[int] = ..., rows_not_admitted: _Optional[int] = ..., rows_cooled: _Optional[int] = ..., cold_rows: _Optional[int] = ..., cold_bytes: _Optional[int] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("name", "incarnation", "epoch", "state", "primary_blocks", "replica_blocks", "bytes", "tables", "clocks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    CLOCKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    incarnation: int
    epoch: int
    state: _common_pb2.ServerState
    primary_blocks: int
    replica_blocks: int
    bytes: int
    tables: _containers.RepeatedCompositeFieldContainer[TableUsage]
    clocks: _containers.RepeatedCompositeFieldContainer[WorkerClock]
    def __init__(self, name: _Optional[str] = ..., incarnation: _Optional[int] = ..., epoch: _Optional[int] = ..., state: _Optional[_Union[_common_pb2.ServerState, str]] = ..., primary_blocks: _Optional[int] = ..., replica_blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[TableUsage, _Mapping]]] = ..., clocks: _Optional[_Iterable[_Union[WorkerClock, _Mapping]]] = ...) -> None: ...

class WorkerClock(_message.Message):
    __slots__ = ("job", "rank", "clock")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    clock: int
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., clock: _Optional[int] = ...) -> None: ...

class OpenDataPlaneRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class OpenDataPlaneResponse(_message.Message):
    __slots__ = ("address", "max_frame_bytes", "packed", "shared_memory", "step")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    address: str
    max_frame_bytes: int
    packed: bool
    shared_memory: bool
    step: bool
    def __init__(self, address: _Optional[str] = ..., max_frame_bytes: _Optional[int] = ..., packed: _Optional[bool] = ..., shared_memory: _Optional[bool] = ..., step: _Optional[bool] = ...) -> None: ...

class ExchangeHeader(_message.Message):
    __slots__ = ("push", "pull")
    PUSH_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    push: PushHeader
    pull: PullRequest
    def __init__(self, push: _Optional[_Union[PushHeader, _Mapping]] = ..., pull: _Optional[_Union[PullRequest, _Mapping]] = ...) -> None: ...

class ExchangeReply(_message.Message):
    __slots__ = ("ack", "pull")
    ACK_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    ack: PushAck
    pull: PullHeader
    def __init__(self, ack: _Optional[_Union[PushAck, _Mapping]] = ..., pull: _Optional[_Union[PullHeader, _Mapping]] = ...) -> None: ...

class StepHeader(_message.Message):
    __slots__ = ("header", "kind", "push", "push_segments", "pull", "pull_clock", "pull_segments", "region")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    PUSH_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    PULL_CLOCK_FIELD_NUMBER: _ClassVar[int]
    PULL_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    kind: PushKind
    push: bool
    push_segments: _containers.RepeatedCompositeFieldContainer[_common_pb2.Segment]
    pull: bool
    pull_clock: int
    pull_segments: _containers.RepeatedCompositeFieldContainer[_common_pb2.Segment]
    region: _common_pb2.SharedMemoryRef
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., kind: _Optional[_Union[PushKind, str]] = ..., push: _Optional[bool] = ..., push_segments: _Optional[_Iterable[_Union[_common_pb2.Segment, _Mapping]]] = ..., pull: _Optional[bool] = ..., pull_clock: _Optional[int] = ..., pull_segments: _Optional[_Iterable[_Union[_common_pb2.Segment, _Mapping]]] = ..., region: _Optional[_Union[_common_pb2.SharedMemoryRef, _Mapping]] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("ack", "pull")
    ACK_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    ack: PushAck
    pull: PullHeader
    def __init__(self, ack: _Optional[_Union[PushAck, _Mapping]] = ..., pull: _Optional[_Union[PullHeader, _Mapping]] = ...) -> None: ...

class GetBlockDigestsRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class BlockDigest(_message.Message):
    __slots__ = ("job", "table", "block", "version", "role", "digest", "rows", "loaded")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    job: str
    table: str
    block: int
    version: int
    role: BlockRole
    digest: bytes
    rows: int
    loaded: bool
    def __init__(self, job: _Optional[str] = ..., table: _Optional[str] = ..., block: _Optional[int] = ..., version: _Optional[int] = ..., role: _Optional[_Union[BlockRole, str]] = ..., digest: _Optional[bytes] = ..., rows: _Optional[int] = ..., loaded: _Optional[bool] = ...) -> None: ...

class GetBlockDigestsResponse(_message.Message):
    __slots__ = ("name", "incarnation", "epoch", "blocks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    incarnation: int
    epoch: int
    blocks: _containers.RepeatedCompositeFieldContainer[BlockDigest]
    def __init__(self, name: _Optional[str] = ..., incarnation: _Optional[int] = ..., epoch: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[BlockDigest, _Mapping]]] = ...) -> None: ...
