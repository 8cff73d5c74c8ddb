from pagedserve.v1 import common_pb2 as _common_pb2
from pagedserve.v1 import executor_pb2 as _executor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExecutorRegistration(_message.Message):
    __slots__ = ("address", "info")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    address: str
    info: _executor_pb2.ExecutorInfo
    def __init__(self, address: _Optional[str] = ..., info: _Optional[_Union[_executor_pb2.ExecutorInfo, _Mapping]] = ...) -> None: ...

class RegistrationReply(_message.Message):
    __slots__ = ("new_pool", "heartbeat_ttl_s")
    NEW_POOL_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TTL_S_FIELD_NUMBER: _ClassVar[int]
    new_pool: bool
    heartbeat_ttl_s: float
    def __init__(self, new_pool: bool = ..., heartbeat_ttl_s: _Optional[float] = ...) -> None: ...

class ListExecutorsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DropExecutorRequest(_message.Message):
    __slots__ = ("address", "epoch", "reason")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    address: str
    epoch: str
    reason: str
    def __init__(self, address: _Optional[str] = ..., epoch: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DropExecutorReply(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: bool
    def __init__(self, dropped: bool = ...) -> None: ...

class RegisteredExecutor(_message.Message):
    __slots__ = ("address", "epoch")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    address: str
    epoch: str
    def __init__(self, address: _Optional[str] = ..., epoch: _Optional[str] = ...) -> None: ...

class ExecutorList(_message.Message):
    __slots__ = ("executors",)
    EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    executors: _containers.RepeatedCompositeFieldContainer[RegisteredExecutor]
    def __init__(self, executors: _Optional[_Iterable[_Union[RegisteredExecutor, _Mapping]]] = ...) -> None: ...

class BlockRequest(_message.Message):
    __slots__ = ("request_id", "num_tokens", "prompt_token_ids", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_tokens: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class RunningRequests(_message.Message):
    __slots__ = ("request_ids", "num_tokens", "num_new_tokens", "new_tokens_starts", "new_token_ids", "executors", "executor_indexes")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_STARTS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_INDEXES_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_new_tokens: _containers.RepeatedScalarFieldContainer[int]
    new_tokens_starts: _containers.RepeatedScalarFieldContainer[int]
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    executors: _containers.RepeatedScalarFieldContainer[str]
    executor_indexes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., num_new_tokens: _Optional[_Iterable[int]] = ..., new_tokens_starts: _Optional[_Iterable[int]] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., executors: _Optional[_Iterable[str]] = ..., executor_indexes: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockStepRequest(_message.Message):
    __slots__ = ("scheduler_id", "executor_epoch", "step_id", "executed_step_ids", "failed_request_ids", "planned_step_id", "free_request_ids", "running", "waiting", "lookahead_slots")
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    EXECUTED_STEP_IDS_FIELD_NUMBER: _ClassVar[int]
    FAILED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    PLANNED_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    FREE_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_SLOTS_FIELD_NUMBER: _ClassVar[int]
    scheduler_id: str
    executor_epoch: str
    step_id: int
    executed_step_ids: _containers.RepeatedScalarFieldContainer[int]
    failed_request_ids: _containers.RepeatedScalarFieldContainer[str]
    planned_step_id: int
    free_request_ids: _containers.RepeatedScalarFieldContainer[str]
    running: RunningRequests
    waiting: _containers.RepeatedCompositeFieldContainer[BlockRequest]
    lookahead_slots: int
    def __init__(self, scheduler_id: _Optional[str] = ..., executor_epoch: _Optional[str] = ..., step_id: _Optional[int] = ..., executed_step_ids: _Optional[_Iterable[int]] = ..., failed_request_ids: _Optional[_Iterable[str]] = ..., planned_step_id: _Optional[int] = ..., free_request_ids: _Optional[_Iterable[str]] = ..., running: _Optional[_Union[RunningRequests, _Mapping]] = ..., waiting: _Optional[_Iterable[_Union[BlockRequest, _Mapping]]] = ..., lookahead_slots: _Optional[int] = ...) -> None: ...

class BlockDelta(_message.Message):
    __slots__ = ("block_ids", "num_cached_tokens", "tier_loads", "num_slots")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIER_LOADS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    tier_loads: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockTransfer]
    num_slots: int
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ..., tier_loads: _Optional[_Iterable[_Union[_common_pb2.BlockTransfer, _Mapping]]] = ..., num_slots: _Optional[int] = ...) -> None: ...

class BlockStepResult(_message.Message):
    __slots__ = ("deltas", "preempted_request_ids", "saves_before", "saves_after", "swap_out", "swap_free", "executor_epoch")
    class DeltasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: BlockDelta
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[BlockDelta, _Mapping]] = ...) -> None: ...
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    SAVES_BEFORE_FIELD_NUMBER: _ClassVar[int]
    SAVES_AFTER_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAP_FREE_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.MessageMap[str, BlockDelta]
    preempted_request_ids: _containers.RepeatedScalarFieldContainer[str]
    saves_before: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockTransfer]
    saves_after: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockTransfer]
    swap_out: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockTransfer]
    swap_free: _containers.RepeatedScalarFieldContainer[bytes]
    executor_epoch: str
    def __init__(self, deltas: _Optional[_Mapping[str, BlockDelta]] = ..., preempted_request_ids: _Optional[_Iterable[str]] = ..., saves_before: _Optional[_Iterable[_Union[_common_pb2.BlockTransfer, _Mapping]]] = ..., saves_after: _Optional[_Iterable[_Union[_common_pb2.BlockTransfer, _Mapping]]] = ..., swap_out: _Optional[_Iterable[_Union[_common_pb2.BlockTransfer, _Mapping]]] = ..., swap_free: _Optional[_Iterable[bytes]] = ..., executor_epoch: _Optional[str] = ...) -> None: ...

class BlockStepResults(_message.Message):
    __slots__ = ("executors",)
    class ExecutorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: BlockStepResult
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[BlockStepResult, _Mapping]] = ...) -> None: ...
    EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    executors: _containers.MessageMap[str, BlockStepResult]
    def __init__(self, executors: _Optional[_Mapping[str, BlockStepResult]] = ...) -> None: ...

class KVCacheStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVCacheStats(_message.Message):
    __slots__ = ("num_blocks", "block_size", "num_free_blocks", "num_in_use", "num_cached_evictable", "num_requests", "usage", "num_step_calls", "prefix_cache_queries", "prefix_cache_hits", "evictions", "tier_hits", "blocks_saved", "tier_errors", "bytes_moved", "num_preemptions", "num_swaps", "blocks_swapped_out", "blocks_swapped_in", "swap_blocks_in_use", "executors")
    class ExecutorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: KVCacheStats
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[KVCacheStats, _Mapping]] = ...) -> None: ...
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_USE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_EVICTABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_STEP_CALLS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    TIER_HITS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SAVED_FIELD_NUMBER: _ClassVar[int]
    TIER_ERRORS_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SWAPPED_OUT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SWAPPED_IN_FIELD_NUMBER: _ClassVar[int]
    SWAP_BLOCKS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_size: int
    num_free_blocks: int
    num_in_use: int
    num_cached_evictable: int
    num_requests: int
    usage: float
    num_step_calls: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    evictions: int
    tier_hits: int
    blocks_saved: int
    tier_errors: int
    bytes_moved: int
    num_preemptions: int
    num_swaps: int
    blocks_swapped_out: int
    blocks_swapped_in: int
    swap_blocks_in_use: int
    executors: _containers.MessageMap[str, KVCacheStats]
    def __init__(self, num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_in_use: _Optional[int] = ..., num_cached_evictable: _Optional[int] = ..., num_requests: _Optional[int] = ..., usage: _Optional[float] = ..., num_step_calls: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., evictions: _Optional[int] = ..., tier_hits: _Optional[int] = ..., blocks_saved: _Optional[int] = ..., tier_errors: _Optional[int] = ..., bytes_moved: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_swaps: _Optional[int] = ..., blocks_swapped_out: _Optional[int] = ..., blocks_swapped_in: _Optional[int] = ..., swap_blocks_in_use: _Optional[int] = ..., executors: _Optional[_Mapping[str, KVCacheStats]] = ...) -> None: ...
