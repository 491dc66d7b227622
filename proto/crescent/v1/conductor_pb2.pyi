from proto.crescent.v1 import kvstore_pb2 as _kvstore_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemberKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMBER_KIND_UNSPECIFIED: _ClassVar[MemberKind]
    MEMBER_KIND_STORE: _ClassVar[MemberKind]
    MEMBER_KIND_PREFILL: _ClassVar[MemberKind]
    MEMBER_KIND_DECODE: _ClassVar[MemberKind]

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_KIND_STORED: _ClassVar[EventKind]
    EVENT_KIND_MOVED: _ClassVar[EventKind]
    EVENT_KIND_REMOVED: _ClassVar[EventKind]
MEMBER_KIND_UNSPECIFIED: MemberKind
MEMBER_KIND_STORE: MemberKind
MEMBER_KIND_PREFILL: MemberKind
MEMBER_KIND_DECODE: MemberKind
EVENT_KIND_UNSPECIFIED: EventKind
EVENT_KIND_STORED: EventKind
EVENT_KIND_MOVED: EventKind
EVENT_KIND_REMOVED: EventKind

class RegisterRequest(_message.Message):
    __slots__ = ("member_id", "kind", "address", "store_node", "kv_bytes_per_token", "namespace", "chunk_tokens", "host_id", "kv_events_endpoint", "kv_events_replay_endpoint")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STORE_NODE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_REPLAY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    kind: MemberKind
    address: str
    store_node: str
    kv_bytes_per_token: int
    namespace: bytes
    chunk_tokens: int
    host_id: str
    kv_events_endpoint: str
    kv_events_replay_endpoint: str
    def __init__(self, member_id: _Optional[str] = ..., kind: _Optional[_Union[MemberKind, str]] = ..., address: _Optional[str] = ..., store_node: _Optional[str] = ..., kv_bytes_per_token: _Optional[int] = ..., namespace: _Optional[bytes] = ..., chunk_tokens: _Optional[int] = ..., host_id: _Optional[str] = ..., kv_events_endpoint: _Optional[str] = ..., kv_events_replay_endpoint: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("incarnation", "heartbeat_interval_s", "dead_timeout_s", "etcd", "etcd_prefix", "member_lease_ttl_s")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    DEAD_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ETCD_FIELD_NUMBER: _ClassVar[int]
    ETCD_PREFIX_FIELD_NUMBER: _ClassVar[int]
    MEMBER_LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    heartbeat_interval_s: float
    dead_timeout_s: float
    etcd: str
    etcd_prefix: str
    member_lease_ttl_s: float
    def __init__(self, incarnation: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., dead_timeout_s: _Optional[float] = ..., etcd: _Optional[str] = ..., etcd_prefix: _Optional[str] = ..., member_lease_ttl_s: _Optional[float] = ...) -> None: ...

class StoreLoad(_message.Message):
    __slots__ = ("tiers", "misses", "bytes_in", "bytes_out", "num_leases", "num_pinned")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[_kvstore_pb2.TierStats]
    misses: int
    bytes_in: int
    bytes_out: int
    num_leases: int
    num_pinned: int
    def __init__(self, tiers: _Optional[_Iterable[_Union[_kvstore_pb2.TierStats, _Mapping]]] = ..., misses: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., num_leases: _Optional[int] = ..., num_pinned: _Optional[int] = ...) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("num_queued_tokens", "num_waiting", "num_running", "num_context_tokens", "kv_usage", "num_generated_tokens", "num_finished")
    NUM_QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_FIELD_NUMBER: _ClassVar[int]
    num_queued_tokens: int
    num_waiting: int
    num_running: int
    num_context_tokens: int
    kv_usage: float
    num_generated_tokens: int
    num_finished: int
    def __init__(self, num_queued_tokens: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_context_tokens: _Optional[int] = ..., kv_usage: _Optional[float] = ..., num_generated_tokens: _Optional[int] = ..., num_finished: _Optional[int] = ...) -> None: ...

class PrefillSample(_message.Message):
    __slots__ = ("num_new_tokens", "num_cached_tokens", "seconds")
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    num_new_tokens: int
    num_cached_tokens: int
    seconds: float
    def __init__(self, num_new_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class DecodeSample(_message.Message):
    __slots__ = ("num_seqs", "num_context_tokens", "seconds")
    NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    num_seqs: int
    num_context_tokens: int
    seconds: float
    def __init__(self, num_seqs: _Optional[int] = ..., num_context_tokens: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("member_id", "incarnation", "store", "engine", "prefill_samples", "decode_samples")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DECODE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    incarnation: int
    store: StoreLoad
    engine: EngineLoad
    prefill_samples: _containers.RepeatedCompositeFieldContainer[PrefillSample]
    decode_samples: _containers.RepeatedCompositeFieldContainer[DecodeSample]
    def __init__(self, member_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., store: _Optional[_Union[StoreLoad, _Mapping]] = ..., engine: _Optional[_Union[EngineLoad, _Mapping]] = ..., prefill_samples: _Optional[_Iterable[_Union[PrefillSample, _Mapping]]] = ..., decode_samples: _Optional[_Iterable[_Union[DecodeSample, _Mapping]]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known", "draining")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    known: bool
    draining: bool
    def __init__(self, known: _Optional[bool] = ..., draining: _Optional[bool] = ...) -> None: ...

class ChunkEvent(_message.Message):
    __slots__ = ("kind", "key", "tier")
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    kind: EventKind
    key: bytes
    tier: _kvstore_pb2.Tier
    def __init__(self, kind: _Optional[_Union[EventKind, str]] = ..., key: _Optional[bytes] = ..., tier: _Optional[_Union[_kvstore_pb2.Tier, str]] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("member_id", "incarnation", "reset", "events")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    incarnation: int
    reset: bool
    events: _containers.RepeatedCompositeFieldContainer[ChunkEvent]
    def __init__(self, member_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., reset: _Optional[bool] = ..., events: _Optional[_Iterable[_Union[ChunkEvent, _Mapping]]] = ...) -> None: ...

class EventsAck(_message.Message):
    __slots__ = ("num_events",)
    NUM_EVENTS_FIELD_NUMBER: _ClassVar[int]
    num_events: int
    def __init__(self, num_events: _Optional[int] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("member_id", "incarnation")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    incarnation: int
    def __init__(self, member_id: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ScheduleRequest(_message.Message):
    __slots__ = ("keys", "num_tokens", "chunk_tokens", "policy", "num_output_tokens", "vllm")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VLLM_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    num_tokens: int
    chunk_tokens: int
    policy: str
    num_output_tokens: int
    vllm: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., num_tokens: _Optional[int] = ..., chunk_tokens: _Optional[int] = ..., policy: _Optional[str] = ..., num_output_tokens: _Optional[int] = ..., vllm: _Optional[bool] = ...) -> None: ...

class EngineRef(_message.Message):
    __slots__ = ("member_id", "address")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    address: str
    def __init__(self, member_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class ScheduleResponse(_message.Message):
    __slots__ = ("accepted", "reject_reason", "prefill", "decode", "source_node", "source_address", "num_cached_chunks", "num_cached_tokens", "predicted_ttft_s", "predicted_tbt_s", "replicate_to", "policy")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECT_REASON_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_NODE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TBT_S_FIELD_NUMBER: _ClassVar[int]
    REPLICATE_TO_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reject_reason: str
    prefill: EngineRef
    decode: EngineRef
    source_node: str
    source_address: str
    num_cached_chunks: int
    num_cached_tokens: int
    predicted_ttft_s: float
    predicted_tbt_s: float
    replicate_to: str
    policy: str
    def __init__(self, accepted: _Optional[bool] = ..., reject_reason: _Optional[str] = ..., prefill: _Optional[_Union[EngineRef, _Mapping]] = ..., decode: _Optional[_Union[EngineRef, _Mapping]] = ..., source_node: _Optional[str] = ..., source_address: _Optional[str] = ..., num_cached_chunks: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., predicted_ttft_s: _Optional[float] = ..., predicted_tbt_s: _Optional[float] = ..., replicate_to: _Optional[str] = ..., policy: _Optional[str] = ...) -> None: ...

class LocateRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Holder(_message.Message):
    __slots__ = ("node_id", "tier")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    tier: _kvstore_pb2.Tier
    def __init__(self, node_id: _Optional[str] = ..., tier: _Optional[_Union[_kvstore_pb2.Tier, str]] = ...) -> None: ...

class KeyHolders(_message.Message):
    __slots__ = ("holders",)
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    holders: _containers.RepeatedCompositeFieldContainer[Holder]
    def __init__(self, holders: _Optional[_Iterable[_Union[Holder, _Mapping]]] = ...) -> None: ...

class NodePrefix(_message.Message):
    __slots__ = ("node_id", "address", "num_prefix")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    num_prefix: int
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., num_prefix: _Optional[int] = ...) -> None: ...

class LocateResponse(_message.Message):
    __slots__ = ("keys", "num_prefix", "nodes")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[KeyHolders]
    num_prefix: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodePrefix]
    def __init__(self, keys: _Optional[_Iterable[_Union[KeyHolders, _Mapping]]] = ..., num_prefix: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodePrefix, _Mapping]]] = ...) -> None: ...

class ListMembersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MemberInfo(_message.Message):
    __slots__ = ("member_id", "kind", "address", "state", "last_seen_s", "incarnation", "store", "engine", "num_chunks", "store_node", "namespace", "chunk_tokens", "predicted_queue_s", "lease_ttl_s", "host_id", "vllm")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    STORE_NODE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    VLLM_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    kind: MemberKind
    address: str
    state: str
    last_seen_s: float
    incarnation: int
    store: StoreLoad
    engine: EngineLoad
    num_chunks: int
    store_node: str
    namespace: bytes
    chunk_tokens: int
    predicted_queue_s: float
    lease_ttl_s: float
    host_id: str
    vllm: bool
    def __init__(self, member_id: _Optional[str] = ..., kind: _Optional[_Union[MemberKind, str]] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., last_seen_s: _Optional[float] = ..., incarnation: _Optional[int] = ..., store: _Optional[_Union[StoreLoad, _Mapping]] = ..., engine: _Optional[_Union[EngineLoad, _Mapping]] = ..., num_chunks: _Optional[int] = ..., store_node: _Optional[str] = ..., namespace: _Optional[bytes] = ..., chunk_tokens: _Optional[int] = ..., predicted_queue_s: _Optional[float] = ..., lease_ttl_s: _Optional[float] = ..., host_id: _Optional[str] = ..., vllm: _Optional[bool] = ...) -> None: ...

class ListMembersResponse(_message.Message):
    __slots__ = ("members", "dead_timeout_s")
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    DEAD_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[MemberInfo]
    dead_timeout_s: float
    def __init__(self, members: _Optional[_Iterable[_Union[MemberInfo, _Mapping]]] = ..., dead_timeout_s: _Optional[float] = ...) -> None: ...

class ClusterStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterStatsResponse(_message.Message):
    __slots__ = ("num_members", "num_chunks", "num_copies", "tiers", "misses", "bytes_in", "bytes_out", "num_scheduled", "num_rejected", "num_replications", "num_scheduled_chunks", "num_cached_chunks", "num_dead", "policy", "cost_coefficients", "num_cost_samples", "num_prefill_samples_received")
    NUM_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_COPIES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    NUM_REJECTED_FIELD_NUMBER: _ClassVar[int]
    NUM_REPLICATIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_DEAD_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    COST_COEFFICIENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_COST_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_SAMPLES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    num_members: int
    num_chunks: int
    num_copies: int
    tiers: _containers.RepeatedCompositeFieldContainer[_kvstore_pb2.TierStats]
    misses: int
    bytes_in: int
    bytes_out: int
    num_scheduled: int
    num_rejected: int
    num_replications: int
    num_scheduled_chunks: int
    num_cached_chunks: int
    num_dead: int
    policy: str
    cost_coefficients: _containers.RepeatedScalarFieldContainer[float]
    num_cost_samples: int
    num_prefill_samples_received: int
    def __init__(self, num_members: _Optional[int] = ..., num_chunks: _Optional[int] = ..., num_copies: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[_kvstore_pb2.TierStats, _Mapping]]] = ..., misses: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., num_scheduled: _Optional[int] = ..., num_rejected: _Optional[int] = ..., num_replications: _Optional[int] = ..., num_scheduled_chunks: _Optional[int] = ..., num_cached_chunks: _Optional[int] = ..., num_dead: _Optional[int] = ..., policy: _Optional[str] = ..., cost_coefficients: _Optional[_Iterable[float]] = ..., num_cost_samples: _Optional[int] = ..., num_prefill_samples_received: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("member_id", "undo")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    UNDO_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    undo: bool
    def __init__(self, member_id: _Optional[str] = ..., undo: _Optional[bool] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: str
    def __init__(self, state: _Optional[str] = ...) -> None: ...

class PinChunksRequest(_message.Message):
    __slots__ = ("keys", "ttl_s")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    ttl_s: float
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class PinChunksResponse(_message.Message):
    __slots__ = ("num_pinned", "num_nodes")
    NUM_PINNED_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    num_pinned: int
    num_nodes: int
    def __init__(self, num_pinned: _Optional[int] = ..., num_nodes: _Optional[int] = ...) -> None: ...

class EvictChunksRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class EvictChunksResponse(_message.Message):
    __slots__ = ("num_evicted", "num_nodes")
    NUM_EVICTED_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    num_evicted: int
    num_nodes: int
    def __init__(self, num_evicted: _Optional[int] = ..., num_nodes: _Optional[int] = ...) -> None: ...

class SizingRequest(_message.Message):
    __slots__ = ("target_rps", "slo_ttft_s", "slo_itl_s", "quantile")
    TARGET_RPS_FIELD_NUMBER: _ClassVar[int]
    SLO_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    SLO_ITL_S_FIELD_NUMBER: _ClassVar[int]
    QUANTILE_FIELD_NUMBER: _ClassVar[int]
    target_rps: float
    slo_ttft_s: float
    slo_itl_s: float
    quantile: float
    def __init__(self, target_rps: _Optional[float] = ..., slo_ttft_s: _Optional[float] = ..., slo_itl_s: _Optional[float] = ..., quantile: _Optional[float] = ...) -> None: ...

class EngineThroughput(_message.Message):
    __slots__ = ("member_id", "kind", "prefill_tokens_per_s", "decode_tokens_per_s", "num_samples")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    kind: MemberKind
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    num_samples: int
    def __init__(self, member_id: _Optional[str] = ..., kind: _Optional[_Union[MemberKind, str]] = ..., prefill_tokens_per_s: _Optional[float] = ..., decode_tokens_per_s: _Optional[float] = ..., num_samples: _Optional[int] = ...) -> None: ...

class SizingResponse(_message.Message):
    __slots__ = ("num_prefill", "num_decode", "feasible", "target_rps", "slo_ttft_s", "slo_itl_s", "quantile", "num_requests", "measured_rps", "mean_prompt_tokens", "mean_cached_tokens", "mean_output_tokens", "predicted_ttft_s", "predicted_itl_s", "prefill_utilization", "decode_batch", "reasoning", "engines")
    NUM_PREFILL_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_FIELD_NUMBER: _ClassVar[int]
    FEASIBLE_FIELD_NUMBER: _ClassVar[int]
    TARGET_RPS_FIELD_NUMBER: _ClassVar[int]
    SLO_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    SLO_ITL_S_FIELD_NUMBER: _ClassVar[int]
    QUANTILE_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_RPS_FIELD_NUMBER: _ClassVar[int]
    MEAN_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_ITL_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    DECODE_BATCH_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    num_prefill: int
    num_decode: int
    feasible: bool
    target_rps: float
    slo_ttft_s: float
    slo_itl_s: float
    quantile: float
    num_requests: int
    measured_rps: float
    mean_prompt_tokens: float
    mean_cached_tokens: float
    mean_output_tokens: float
    predicted_ttft_s: float
    predicted_itl_s: float
    prefill_utilization: float
    decode_batch: float
    reasoning: _containers.RepeatedScalarFieldContainer[str]
    engines: _containers.RepeatedCompositeFieldContainer[EngineThroughput]
    def __init__(self, num_prefill: _Optional[int] = ..., num_decode: _Optional[int] = ..., feasible: _Optional[bool] = ..., target_rps: _Optional[float] = ..., slo_ttft_s: _Optional[float] = ..., slo_itl_s: _Optional[float] = ..., quantile: _Optional[float] = ..., num_requests: _Optional[int] = ..., measured_rps: _Optional[float] = ..., mean_prompt_tokens: _Optional[float] = ..., mean_cached_tokens: _Optional[float] = ..., mean_output_tokens: _Optional[float] = ..., predicted_ttft_s: _Optional[float] = ..., predicted_itl_s: _Optional[float] = ..., prefill_utilization: _Optional[float] = ..., decode_batch: _Optional[float] = ..., reasoning: _Optional[_Iterable[str]] = ..., engines: _Optional[_Iterable[_Union[EngineThroughput, _Mapping]]] = ...) -> None: ...
