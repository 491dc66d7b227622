from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_DEVICE: _ClassVar[Tier]
    TIER_DRAM: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]

class Mover(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MOVER_UNSPECIFIED: _ClassVar[Mover]
    MOVER_GRPC: _ClassVar[Mover]
    MOVER_TCP: _ClassVar[Mover]
    MOVER_SHM: _ClassVar[Mover]
    MOVER_RDMA: _ClassVar[Mover]
    MOVER_CUDA_IPC: _ClassVar[Mover]

class ItemStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ITEM_STATUS_UNSPECIFIED: _ClassVar[ItemStatus]
    ITEM_OK: _ClassVar[ItemStatus]
    ITEM_NOT_FOUND: _ClassVar[ItemStatus]
    ITEM_ELSEWHERE: _ClassVar[ItemStatus]
    ITEM_EXHAUSTED: _ClassVar[ItemStatus]
TIER_UNSPECIFIED: Tier
TIER_DEVICE: Tier
TIER_DRAM: Tier
TIER_DISK: Tier
MOVER_UNSPECIFIED: Mover
MOVER_GRPC: Mover
MOVER_TCP: Mover
MOVER_SHM: Mover
MOVER_RDMA: Mover
MOVER_CUDA_IPC: Mover
ITEM_STATUS_UNSPECIFIED: ItemStatus
ITEM_OK: ItemStatus
ITEM_NOT_FOUND: ItemStatus
ITEM_ELSEWHERE: ItemStatus
ITEM_EXHAUSTED: ItemStatus

class ValueHeader(_message.Message):
    __slots__ = ("key", "size")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    size: int
    def __init__(self, key: _Optional[bytes] = ..., size: _Optional[int] = ...) -> None: ...

class PutFrame(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ValueHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ValueHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("num_stored", "num_bytes")
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_stored: int
    num_bytes: int
    def __init__(self, num_stored: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GetHeader(_message.Message):
    __slots__ = ("index", "found", "size", "tier")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    index: int
    found: bool
    size: int
    tier: Tier
    def __init__(self, index: _Optional[int] = ..., found: _Optional[bool] = ..., size: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class GetFrame(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: GetHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[GetHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class KeysRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_prefix", "tiers")
    NUM_PREFIX_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    num_prefix: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, num_prefix: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class ExistsResponse(_message.Message):
    __slots__ = ("present",)
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, present: _Optional[_Iterable[bool]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("num_deleted",)
    NUM_DELETED_FIELD_NUMBER: _ClassVar[int]
    num_deleted: int
    def __init__(self, num_deleted: _Optional[int] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("keys", "ttl_s")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    ttl_s: float
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("num_pinned",)
    NUM_PINNED_FIELD_NUMBER: _ClassVar[int]
    num_pinned: int
    def __init__(self, num_pinned: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "capacity_bytes", "used_bytes", "num_entries", "hits", "evictions")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    capacity_bytes: int
    used_bytes: int
    num_entries: int
    hits: int
    evictions: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., num_entries: _Optional[int] = ..., hits: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "misses", "demotions", "promotions", "drops", "num_leases", "num_pinned", "node_id", "movers", "transport", "num_remote_leases", "num_remote_reservations", "num_expired_leases", "num_expired_reservations")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    DROPS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MOVERS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    NUM_REMOTE_LEASES_FIELD_NUMBER: _ClassVar[int]
    NUM_REMOTE_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPIRED_LEASES_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPIRED_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    misses: int
    demotions: int
    promotions: int
    drops: int
    num_leases: int
    num_pinned: int
    node_id: str
    movers: _containers.RepeatedCompositeFieldContainer[MoverStats]
    transport: str
    num_remote_leases: int
    num_remote_reservations: int
    num_expired_leases: int
    num_expired_reservations: int
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., misses: _Optional[int] = ..., demotions: _Optional[int] = ..., promotions: _Optional[int] = ..., drops: _Optional[int] = ..., num_leases: _Optional[int] = ..., num_pinned: _Optional[int] = ..., node_id: _Optional[str] = ..., movers: _Optional[_Iterable[_Union[MoverStats, _Mapping]]] = ..., transport: _Optional[str] = ..., num_remote_leases: _Optional[int] = ..., num_remote_reservations: _Optional[int] = ..., num_expired_leases: _Optional[int] = ..., num_expired_reservations: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("serving", "node_id", "version", "max_key_bytes", "max_value_bytes", "data_port", "data_token", "data_ops")
    SERVING_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_KEY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_VALUE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DATA_OPS_FIELD_NUMBER: _ClassVar[int]
    serving: bool
    node_id: str
    version: str
    max_key_bytes: int
    max_value_bytes: int
    data_port: int
    data_token: bytes
    data_ops: int
    def __init__(self, serving: _Optional[bool] = ..., node_id: _Optional[str] = ..., version: _Optional[str] = ..., max_key_bytes: _Optional[int] = ..., max_value_bytes: _Optional[int] = ..., data_port: _Optional[int] = ..., data_token: _Optional[bytes] = ..., data_ops: _Optional[int] = ...) -> None: ...

class TransportsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HostIdentity(_message.Message):
    __slots__ = ("hostname", "boot_id")
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    hostname: str
    boot_id: str
    def __init__(self, hostname: _Optional[str] = ..., boot_id: _Optional[str] = ...) -> None: ...

class ArenaInfo(_message.Message):
    __slots__ = ("name", "size", "slot_bytes", "file_dev", "file_ino", "rdma_addr", "rdma_rkey", "table_offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    FILE_DEV_FIELD_NUMBER: _ClassVar[int]
    FILE_INO_FIELD_NUMBER: _ClassVar[int]
    RDMA_ADDR_FIELD_NUMBER: _ClassVar[int]
    RDMA_RKEY_FIELD_NUMBER: _ClassVar[int]
    TABLE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    slot_bytes: int
    file_dev: int
    file_ino: int
    rdma_addr: int
    rdma_rkey: int
    table_offset: int
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., file_dev: _Optional[int] = ..., file_ino: _Optional[int] = ..., rdma_addr: _Optional[int] = ..., rdma_rkey: _Optional[int] = ..., table_offset: _Optional[int] = ...) -> None: ...

class RdmaEndpoint(_message.Message):
    __slots__ = ("available", "reason", "device", "port", "num_queue_pairs")
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUE_PAIRS_FIELD_NUMBER: _ClassVar[int]
    available: bool
    reason: str
    device: str
    port: int
    num_queue_pairs: int
    def __init__(self, available: _Optional[bool] = ..., reason: _Optional[str] = ..., device: _Optional[str] = ..., port: _Optional[int] = ..., num_queue_pairs: _Optional[int] = ...) -> None: ...

class DeviceArenaInfo(_message.Message):
    __slots__ = ("available", "reason", "name", "size", "slot_bytes", "device_uuid", "device_index", "ipc_handle", "storage_bytes", "storage_offset", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    available: bool
    reason: str
    name: str
    size: int
    slot_bytes: int
    device_uuid: str
    device_index: int
    ipc_handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, available: _Optional[bool] = ..., reason: _Optional[str] = ..., name: _Optional[str] = ..., size: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., device_uuid: _Optional[str] = ..., device_index: _Optional[int] = ..., ipc_handle: _Optional[bytes] = ..., storage_bytes: _Optional[int] = ..., storage_offset: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class TransportsResponse(_message.Message):
    __slots__ = ("host", "arena", "offered", "lease_ttl_s", "rdma", "device_arena")
    HOST_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    OFFERED_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    RDMA_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ARENA_FIELD_NUMBER: _ClassVar[int]
    host: HostIdentity
    arena: ArenaInfo
    offered: _containers.RepeatedScalarFieldContainer[Mover]
    lease_ttl_s: float
    rdma: RdmaEndpoint
    device_arena: DeviceArenaInfo
    def __init__(self, host: _Optional[_Union[HostIdentity, _Mapping]] = ..., arena: _Optional[_Union[ArenaInfo, _Mapping]] = ..., offered: _Optional[_Iterable[_Union[Mover, str]]] = ..., lease_ttl_s: _Optional[float] = ..., rdma: _Optional[_Union[RdmaEndpoint, _Mapping]] = ..., device_arena: _Optional[_Union[DeviceArenaInfo, _Mapping]] = ...) -> None: ...

class AcquireReadRequest(_message.Message):
    __slots__ = ("keys", "mover")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    MOVER_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    mover: Mover
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., mover: _Optional[_Union[Mover, str]] = ...) -> None: ...

class SlotDescriptor(_message.Message):
    __slots__ = ("index", "status", "size", "tier", "slots", "generations")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    index: int
    status: ItemStatus
    size: int
    tier: Tier
    slots: _containers.RepeatedScalarFieldContainer[int]
    generations: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, index: _Optional[int] = ..., status: _Optional[_Union[ItemStatus, str]] = ..., size: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ..., slots: _Optional[_Iterable[int]] = ..., generations: _Optional[_Iterable[int]] = ...) -> None: ...

class AcquireReadResponse(_message.Message):
    __slots__ = ("lease_id", "expires_in_s", "arena", "items")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    expires_in_s: float
    arena: str
    items: _containers.RepeatedCompositeFieldContainer[SlotDescriptor]
    def __init__(self, lease_id: _Optional[int] = ..., expires_in_s: _Optional[float] = ..., arena: _Optional[str] = ..., items: _Optional[_Iterable[_Union[SlotDescriptor, _Mapping]]] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class ReleaseReadResponse(_message.Message):
    __slots__ = ("num_values", "num_bytes")
    NUM_VALUES_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_values: int
    num_bytes: int
    def __init__(self, num_values: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class ReserveWriteRequest(_message.Message):
    __slots__ = ("values", "mover")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    MOVER_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedCompositeFieldContainer[ValueHeader]
    mover: Mover
    def __init__(self, values: _Optional[_Iterable[_Union[ValueHeader, _Mapping]]] = ..., mover: _Optional[_Union[Mover, str]] = ...) -> None: ...

class ReserveWriteResponse(_message.Message):
    __slots__ = ("lease_id", "expires_in_s", "arena", "items", "message")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    expires_in_s: float
    arena: str
    items: _containers.RepeatedCompositeFieldContainer[SlotDescriptor]
    message: str
    def __init__(self, lease_id: _Optional[int] = ..., expires_in_s: _Optional[float] = ..., arena: _Optional[str] = ..., items: _Optional[_Iterable[_Union[SlotDescriptor, _Mapping]]] = ..., message: _Optional[str] = ...) -> None: ...

class CommitWriteResponse(_message.Message):
    __slots__ = ("num_stored", "num_bytes")
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_stored: int
    num_bytes: int
    def __init__(self, num_stored: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class AbortWriteResponse(_message.Message):
    __slots__ = ("num_aborted",)
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    num_aborted: int
    def __init__(self, num_aborted: _Optional[int] = ...) -> None: ...

class RdmaConnectRequest(_message.Message):
    __slots__ = ("gid", "lid", "qp_num", "psn", "rd_atomic", "replaces_qp_num", "replaces_client_qp_num")
    GID_FIELD_NUMBER: _ClassVar[int]
    LID_FIELD_NUMBER: _ClassVar[int]
    QP_NUM_FIELD_NUMBER: _ClassVar[int]
    PSN_FIELD_NUMBER: _ClassVar[int]
    RD_ATOMIC_FIELD_NUMBER: _ClassVar[int]
    REPLACES_QP_NUM_FIELD_NUMBER: _ClassVar[int]
    REPLACES_CLIENT_QP_NUM_FIELD_NUMBER: _ClassVar[int]
    gid: bytes
    lid: int
    qp_num: int
    psn: int
    rd_atomic: int
    replaces_qp_num: int
    replaces_client_qp_num: int
    def __init__(self, gid: _Optional[bytes] = ..., lid: _Optional[int] = ..., qp_num: _Optional[int] = ..., psn: _Optional[int] = ..., rd_atomic: _Optional[int] = ..., replaces_qp_num: _Optional[int] = ..., replaces_client_qp_num: _Optional[int] = ...) -> None: ...

class RdmaConnectResponse(_message.Message):
    __slots__ = ("gid", "lid", "qp_num", "psn", "addr", "rkey", "rd_atomic")
    GID_FIELD_NUMBER: _ClassVar[int]
    LID_FIELD_NUMBER: _ClassVar[int]
    QP_NUM_FIELD_NUMBER: _ClassVar[int]
    PSN_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    RKEY_FIELD_NUMBER: _ClassVar[int]
    RD_ATOMIC_FIELD_NUMBER: _ClassVar[int]
    gid: bytes
    lid: int
    qp_num: int
    psn: int
    addr: int
    rkey: int
    rd_atomic: int
    def __init__(self, gid: _Optional[bytes] = ..., lid: _Optional[int] = ..., qp_num: _Optional[int] = ..., psn: _Optional[int] = ..., addr: _Optional[int] = ..., rkey: _Optional[int] = ..., rd_atomic: _Optional[int] = ...) -> None: ...

class RdmaDisconnectRequest(_message.Message):
    __slots__ = ("gid", "qp_num", "client_qp_num")
    GID_FIELD_NUMBER: _ClassVar[int]
    QP_NUM_FIELD_NUMBER: _ClassVar[int]
    CLIENT_QP_NUM_FIELD_NUMBER: _ClassVar[int]
    gid: bytes
    qp_num: int
    client_qp_num: int
    def __init__(self, gid: _Optional[bytes] = ..., qp_num: _Optional[int] = ..., client_qp_num: _Optional[int] = ...) -> None: ...

class RdmaDisconnectResponse(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: bool
    def __init__(self, closed: _Optional[bool] = ...) -> None: ...

class MoverStats(_message.Message):
    __slots__ = ("mover", "num_reads", "num_writes", "bytes_read", "bytes_written")
    MOVER_FIELD_NUMBER: _ClassVar[int]
    NUM_READS_FIELD_NUMBER: _ClassVar[int]
    NUM_WRITES_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    mover: Mover
    num_reads: int
    num_writes: int
    bytes_read: int
    bytes_written: int
    def __init__(self, mover: _Optional[_Union[Mover, str]] = ..., num_reads: _Optional[int] = ..., num_writes: _Optional[int] = ..., bytes_read: _Optional[int] = ..., bytes_written: _Optional[int] = ...) -> None: ...
