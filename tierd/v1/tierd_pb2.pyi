from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVSpec(_message.Message):
    __slots__ = ("model_id", "revision", "num_layers", "num_kv_heads", "head_dim", "dtype", "block_tokens", "layout_version", "arrangement", "kind", "opaque_page_bytes", "extra")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ARRANGEMENT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    OPAQUE_PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    revision: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_tokens: int
    layout_version: int
    arrangement: str
    kind: str
    opaque_page_bytes: int
    extra: str
    def __init__(self, model_id: _Optional[str] = ..., revision: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., block_tokens: _Optional[int] = ..., layout_version: _Optional[int] = ..., arrangement: _Optional[str] = ..., kind: _Optional[str] = ..., opaque_page_bytes: _Optional[int] = ..., extra: _Optional[str] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("region", "offset", "stride", "nbytes")
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    region: int
    offset: int
    stride: int
    nbytes: int
    def __init__(self, region: _Optional[int] = ..., offset: _Optional[int] = ..., stride: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class Region(_message.Message):
    __slots__ = ("shm_name", "cuda_ipc", "shm_fd", "size")
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    SHM_FD_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    shm_name: str
    cuda_ipc: CudaIpcMemory
    shm_fd: int
    size: int
    def __init__(self, shm_name: _Optional[str] = ..., cuda_ipc: _Optional[_Union[CudaIpcMemory, _Mapping]] = ..., shm_fd: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class CudaIpcMemory(_message.Message):
    __slots__ = ("handle", "offset", "device_uuid")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    offset: int
    device_uuid: str
    def __init__(self, handle: _Optional[bytes] = ..., offset: _Optional[int] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class RegisterEngineRequest(_message.Message):
    __slots__ = ("spec", "regions", "num_blocks", "segments", "pid", "fd_ticket")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    FD_TICKET_FIELD_NUMBER: _ClassVar[int]
    spec: KVSpec
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    num_blocks: int
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    pid: int
    fd_ticket: str
    def __init__(self, spec: _Optional[_Union[KVSpec, _Mapping]] = ..., regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ..., num_blocks: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., pid: _Optional[int] = ..., fd_ticket: _Optional[str] = ...) -> None: ...

class RegisterEngineResponse(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class EngineRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class SaveRequest(_message.Message):
    __slots__ = ("engine_id", "session_id", "block_ids", "num_tokens", "start_token", "tier", "priority", "token_ids", "cache_salt", "lossy_max_error")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LOSSY_MAX_ERROR_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    session_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    start_token: int
    tier: str
    priority: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    lossy_max_error: float
    def __init__(self, engine_id: _Optional[str] = ..., session_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., start_token: _Optional[int] = ..., tier: _Optional[str] = ..., priority: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., lossy_max_error: _Optional[float] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("engine_id", "session_id", "block_ids", "token_ids", "cache_salt", "whole")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    WHOLE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    session_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    whole: bool
    def __init__(self, engine_id: _Optional[str] = ..., session_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., whole: bool = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("num_tokens", "num_pages", "source_tier", "seconds", "nbytes", "rel_error")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TIER_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    REL_ERROR_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    num_pages: int
    source_tier: str
    seconds: float
    nbytes: int
    rel_error: float
    def __init__(self, num_tokens: _Optional[int] = ..., num_pages: _Optional[int] = ..., source_tier: _Optional[str] = ..., seconds: _Optional[float] = ..., nbytes: _Optional[int] = ..., rel_error: _Optional[float] = ...) -> None: ...

class PutHeader(_message.Message):
    __slots__ = ("session_id", "spec", "num_tokens", "size", "priority", "start_token", "token_ids", "cache_salt", "lossy_max_error")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LOSSY_MAX_ERROR_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    spec: KVSpec
    num_tokens: int
    size: int
    priority: int
    start_token: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    lossy_max_error: float
    def __init__(self, session_id: _Optional[str] = ..., spec: _Optional[_Union[KVSpec, _Mapping]] = ..., num_tokens: _Optional[int] = ..., size: _Optional[int] = ..., priority: _Optional[int] = ..., start_token: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., lossy_max_error: _Optional[float] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("data", "xxh3")
    DATA_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    xxh3: int
    def __init__(self, data: _Optional[bytes] = ..., xxh3: _Optional[int] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PutHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[PutHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("session_id", "chunk_bytes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    chunk_bytes: int
    def __init__(self, session_id: _Optional[str] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: SessionInfo
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[SessionInfo, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "tier", "tier_bytes", "state", "num_tokens", "size_bytes", "num_pages", "durable", "last_access", "created", "priority", "pins", "spec", "fingerprint", "tenant", "remote_durable", "shared_bytes", "codecs", "coded_bytes", "tier_errors", "rel_error")
    class TierBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class CodecsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class CodedBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TierErrorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    TIER_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    LAST_ACCESS_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REMOTE_DURABLE_FIELD_NUMBER: _ClassVar[int]
    SHARED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    CODED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_ERRORS_FIELD_NUMBER: _ClassVar[int]
    REL_ERROR_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tier: str
    tier_bytes: _containers.ScalarMap[str, int]
    state: str
    num_tokens: int
    size_bytes: int
    num_pages: int
    durable: bool
    last_access: float
    created: float
    priority: int
    pins: int
    spec: KVSpec
    fingerprint: str
    tenant: str
    remote_durable: bool
    shared_bytes: int
    codecs: _containers.ScalarMap[str, str]
    coded_bytes: _containers.ScalarMap[str, int]
    tier_errors: _containers.ScalarMap[str, float]
    rel_error: float
    def __init__(self, session_id: _Optional[str] = ..., tier: _Optional[str] = ..., tier_bytes: _Optional[_Mapping[str, int]] = ..., state: _Optional[str] = ..., num_tokens: _Optional[int] = ..., size_bytes: _Optional[int] = ..., num_pages: _Optional[int] = ..., durable: bool = ..., last_access: _Optional[float] = ..., created: _Optional[float] = ..., priority: _Optional[int] = ..., pins: _Optional[int] = ..., spec: _Optional[_Union[KVSpec, _Mapping]] = ..., fingerprint: _Optional[str] = ..., tenant: _Optional[str] = ..., remote_durable: bool = ..., shared_bytes: _Optional[int] = ..., codecs: _Optional[_Mapping[str, str]] = ..., coded_bytes: _Optional[_Mapping[str, int]] = ..., tier_errors: _Optional[_Mapping[str, float]] = ..., rel_error: _Optional[float] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("session_id", "tier", "priority", "deadline_seconds")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tier: str
    priority: int
    deadline_seconds: float
    def __init__(self, session_id: _Optional[str] = ..., tier: _Optional[str] = ..., priority: _Optional[int] = ..., deadline_seconds: _Optional[float] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: str
    def __init__(self, status: _Optional[str] = ...) -> None: ...

class WaitReadyRequest(_message.Message):
    __slots__ = ("session_id", "tier", "timeout_seconds")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tier: str
    timeout_seconds: float
    def __init__(self, session_id: _Optional[str] = ..., tier: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class WaitReadyResponse(_message.Message):
    __slots__ = ("ready", "tier")
    READY_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    tier: str
    def __init__(self, ready: bool = ..., tier: _Optional[str] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("limit", "page_token", "all_tenants")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ALL_TENANTS_FIELD_NUMBER: _ClassVar[int]
    limit: int
    page_token: str
    all_tenants: bool
    def __init__(self, limit: _Optional[int] = ..., page_token: _Optional[str] = ..., all_tenants: bool = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("sessions", "next_page_token")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    next_page_token: str
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "budget", "used", "capacity", "sessions", "backend", "saved")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    SAVED_FIELD_NUMBER: _ClassVar[int]
    name: str
    budget: int
    used: int
    capacity: int
    sessions: int
    backend: str
    saved: int
    def __init__(self, name: _Optional[str] = ..., budget: _Optional[int] = ..., used: _Optional[int] = ..., capacity: _Optional[int] = ..., sessions: _Optional[int] = ..., backend: _Optional[str] = ..., saved: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "bandwidth", "moved_bytes", "copy_ops", "version", "backends", "sessions")
    class BandwidthEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class MovedBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class BackendsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TIERS_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    MOVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COPY_OPS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    bandwidth: _containers.ScalarMap[str, float]
    moved_bytes: _containers.ScalarMap[str, int]
    copy_ops: int
    version: str
    backends: _containers.ScalarMap[str, str]
    sessions: int
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., bandwidth: _Optional[_Mapping[str, float]] = ..., moved_bytes: _Optional[_Mapping[str, int]] = ..., copy_ops: _Optional[int] = ..., version: _Optional[str] = ..., backends: _Optional[_Mapping[str, str]] = ..., sessions: _Optional[int] = ...) -> None: ...

class SetBudgetRequest(_message.Message):
    __slots__ = ("tier", "budget")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    tier: str
    budget: int
    def __init__(self, tier: _Optional[str] = ..., budget: _Optional[int] = ...) -> None: ...

class SetBudgetResponse(_message.Message):
    __slots__ = ("tier", "old_budget", "new_budget", "released_bytes", "moved_sessions", "seconds")
    TIER_FIELD_NUMBER: _ClassVar[int]
    OLD_BUDGET_FIELD_NUMBER: _ClassVar[int]
    NEW_BUDGET_FIELD_NUMBER: _ClassVar[int]
    RELEASED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MOVED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    old_budget: int
    new_budget: int
    released_bytes: int
    moved_sessions: int
    seconds: float
    def __init__(self, tier: _Optional[str] = ..., old_budget: _Optional[int] = ..., new_budget: _Optional[int] = ..., released_bytes: _Optional[int] = ..., moved_sessions: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class AdviseRequest(_message.Message):
    __slots__ = ("session_id", "prefill_tokens_per_s", "max_error")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    MAX_ERROR_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prefill_tokens_per_s: float
    max_error: float
    def __init__(self, session_id: _Optional[str] = ..., prefill_tokens_per_s: _Optional[float] = ..., max_error: _Optional[float] = ...) -> None: ...

class AdviseResponse(_message.Message):
    __slots__ = ("restore", "restore_seconds", "recompute_seconds", "source_tier", "bandwidth_bytes_per_s")
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    RESTORE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TIER_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    restore: bool
    restore_seconds: float
    recompute_seconds: float
    source_tier: str
    bandwidth_bytes_per_s: float
    def __init__(self, restore: bool = ..., restore_seconds: _Optional[float] = ..., recompute_seconds: _Optional[float] = ..., source_tier: _Optional[str] = ..., bandwidth_bytes_per_s: _Optional[float] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("session_id", "token_ids", "spec", "cache_salt", "max_error")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MAX_ERROR_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    spec: KVSpec
    cache_salt: str
    max_error: float
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., spec: _Optional[_Union[KVSpec, _Mapping]] = ..., cache_salt: _Optional[str] = ..., max_error: _Optional[float] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_tokens", "num_pages", "stored_tokens", "tier")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    STORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    num_pages: int
    stored_tokens: int
    tier: str
    def __init__(self, num_tokens: _Optional[int] = ..., num_pages: _Optional[int] = ..., stored_tokens: _Optional[int] = ..., tier: _Optional[str] = ...) -> None: ...

class BeginSaveRequest(_message.Message):
    __slots__ = ("session_id", "spec", "num_tokens", "start_token", "token_ids", "priority", "ttl_seconds", "cache_salt", "lossy_max_error", "size")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LOSSY_MAX_ERROR_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    spec: KVSpec
    num_tokens: int
    start_token: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    priority: int
    ttl_seconds: float
    cache_salt: str
    lossy_max_error: float
    size: int
    def __init__(self, session_id: _Optional[str] = ..., spec: _Optional[_Union[KVSpec, _Mapping]] = ..., num_tokens: _Optional[int] = ..., start_token: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., priority: _Optional[int] = ..., ttl_seconds: _Optional[float] = ..., cache_salt: _Optional[str] = ..., lossy_max_error: _Optional[float] = ..., size: _Optional[int] = ...) -> None: ...

class BeginRestoreRequest(_message.Message):
    __slots__ = ("session_id", "spec", "num_pages", "ttl_seconds", "token_ids", "cache_salt")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    spec: KVSpec
    num_pages: int
    ttl_seconds: float
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    def __init__(self, session_id: _Optional[str] = ..., spec: _Optional[_Union[KVSpec, _Mapping]] = ..., num_pages: _Optional[int] = ..., ttl_seconds: _Optional[float] = ..., token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class Slot(_message.Message):
    __slots__ = ("shm_name", "offset", "first_page", "num_pages")
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    FIRST_PAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    shm_name: str
    offset: int
    first_page: int
    num_pages: int
    def __init__(self, shm_name: _Optional[str] = ..., offset: _Optional[int] = ..., first_page: _Optional[int] = ..., num_pages: _Optional[int] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "slots", "page_bytes", "page_stride", "first_page", "num_pages", "num_tokens", "ttl_seconds", "nbytes", "rel_error")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_STRIDE_FIELD_NUMBER: _ClassVar[int]
    FIRST_PAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    REL_ERROR_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    slots: _containers.RepeatedCompositeFieldContainer[Slot]
    page_bytes: int
    page_stride: int
    first_page: int
    num_pages: int
    num_tokens: int
    ttl_seconds: float
    nbytes: int
    rel_error: float
    def __init__(self, lease_id: _Optional[str] = ..., slots: _Optional[_Iterable[_Union[Slot, _Mapping]]] = ..., page_bytes: _Optional[int] = ..., page_stride: _Optional[int] = ..., first_page: _Optional[int] = ..., num_pages: _Optional[int] = ..., num_tokens: _Optional[int] = ..., ttl_seconds: _Optional[float] = ..., nbytes: _Optional[int] = ..., rel_error: _Optional[float] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
