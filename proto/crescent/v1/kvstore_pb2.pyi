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
TIER_UNSPECIFIED: Tier
TIER_DEVICE: Tier
TIER_DRAM: Tier
TIER_DISK: Tier

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
    __slots__ = ("tiers", "misses", "demotions", "promotions", "drops", "num_leases", "num_pinned", "node_id")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    DROPS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    misses: int
    demotions: int
    promotions: int
    drops: int
    num_leases: int
    num_pinned: int
    node_id: str
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., misses: _Optional[int] = ..., demotions: _Optional[int] = ..., promotions: _Optional[int] = ..., drops: _Optional[int] = ..., num_leases: _Optional[int] = ..., num_pinned: _Optional[int] = ..., node_id: _Optional[str] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("serving", "node_id", "version", "max_key_bytes", "max_value_bytes", "data_port", "data_token")
    SERVING_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_KEY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_VALUE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_TOKEN_FIELD_NUMBER: _ClassVar[int]
    serving: bool
    node_id: str
    version: str
    max_key_bytes: int
    max_value_bytes: int
    data_port: int
    data_token: bytes
    def __init__(self, serving: _Optional[bool] = ..., node_id: _Optional[str] = ..., version: _Optional[str] = ..., max_key_bytes: _Optional[int] = ..., max_value_bytes: _Optional[int] = ..., data_port: _Optional[int] = ..., data_token: _Optional[bytes] = ...) -> None: ...
