from pagedserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExecuteRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "start_position", "new_block_ids", "sample", "sampling", "prompt_len", "load_blocks", "prefix_token_ids", "feed_sampled", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    LOAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FEED_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    start_position: int
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    sample: bool
    sampling: _common_pb2.SamplingParams
    prompt_len: int
    load_blocks: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockTransfer]
    prefix_token_ids: _containers.RepeatedScalarFieldContainer[int]
    feed_sampled: bool
    prompt_logprobs: bool
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., start_position: _Optional[int] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., sample: bool = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., prompt_len: _Optional[int] = ..., load_blocks: _Optional[_Iterable[_Union[_common_pb2.BlockTransfer, _Mapping]]] = ..., prefix_token_ids: _Optional[_Iterable[int]] = ..., feed_sampled: bool = ..., prompt_logprobs: bool = ...) -> None: ...

class DecodeRows(_message.Message):
    __slots__ = ("request_ids", "positions", "token_ids", "block_rows", "block_ids")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ROWS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    positions: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_rows: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., positions: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_rows: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ExecuteStep(_message.Message):
    __slots__ = ("requests", "decodes", "finished_request_ids", "save_blocks", "save_blocks_after", "executor_epoch", "scheduler_id", "step_id", "swap_out", "swap_free")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DECODES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    SAVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SAVE_BLOCKS_AFTER_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAP_FREE_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[ExecuteRequest]
    decodes: DecodeRows
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    save_blocks: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockTransfer]
    save_blocks_after: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockTransfer]
    executor_epoch: str
    scheduler_id: str
    step_id: int
    swap_out: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockTransfer]
    swap_free: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, requests: _Optional[_Iterable[_Union[ExecuteRequest, _Mapping]]] = ..., decodes: _Optional[_Union[DecodeRows, _Mapping]] = ..., finished_request_ids: _Optional[_Iterable[str]] = ..., save_blocks: _Optional[_Iterable[_Union[_common_pb2.BlockTransfer, _Mapping]]] = ..., save_blocks_after: _Optional[_Iterable[_Union[_common_pb2.BlockTransfer, _Mapping]]] = ..., executor_epoch: _Optional[str] = ..., scheduler_id: _Optional[str] = ..., step_id: _Optional[int] = ..., swap_out: _Optional[_Iterable[_Union[_common_pb2.BlockTransfer, _Mapping]]] = ..., swap_free: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ExecuteResult(_message.Message):
    __slots__ = ("sampled_request_ids", "sampled_token_ids", "sampled_logprobs", "num_prefill_tokens", "num_decode_tokens", "num_loaded_blocks", "num_failed_loads", "rejected", "step_id", "error", "prompt_logprobs", "deferred")
    class SampledLogprobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _common_pb2.TokenLogprob
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...
    class RejectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class PromptLogprobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _common_pb2.PromptLogprobs
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_common_pb2.PromptLogprobs, _Mapping]] = ...) -> None: ...
    SAMPLED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_LOADS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_FIELD_NUMBER: _ClassVar[int]
    sampled_request_ids: _containers.RepeatedScalarFieldContainer[str]
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampled_logprobs: _containers.MessageMap[str, _common_pb2.TokenLogprob]
    num_prefill_tokens: int
    num_decode_tokens: int
    num_loaded_blocks: int
    num_failed_loads: int
    rejected: _containers.ScalarMap[str, str]
    step_id: int
    error: StepError
    prompt_logprobs: _containers.MessageMap[str, _common_pb2.PromptLogprobs]
    deferred: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sampled_request_ids: _Optional[_Iterable[str]] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ..., sampled_logprobs: _Optional[_Mapping[str, _common_pb2.TokenLogprob]] = ..., num_prefill_tokens: _Optional[int] = ..., num_decode_tokens: _Optional[int] = ..., num_loaded_blocks: _Optional[int] = ..., num_failed_loads: _Optional[int] = ..., rejected: _Optional[_Mapping[str, str]] = ..., step_id: _Optional[int] = ..., error: _Optional[_Union[StepError, _Mapping]] = ..., prompt_logprobs: _Optional[_Mapping[str, _common_pb2.PromptLogprobs]] = ..., deferred: _Optional[_Iterable[str]] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class ExecutorInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExecutorInfo(_message.Message):
    __slots__ = ("model", "model_dir", "num_blocks", "block_size", "max_model_len", "vocab_size", "eos_token_ids", "attention_backend", "device", "dtype", "num_prefill_tokens", "num_decode_tokens", "offload", "blocks_saved", "blocks_loaded", "failed_loads", "bytes_moved", "tier_errors", "offload_capacity_blocks", "offload_redis_url", "model_id", "block_bytes", "epoch", "swap_capacity_blocks", "prefill_tokens_per_s", "copy_bytes_per_s", "kv_cache_dtype")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SAVED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_LOADED_FIELD_NUMBER: _ClassVar[int]
    FAILED_LOADS_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    TIER_ERRORS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_REDIS_URL_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SWAP_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    COPY_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_dir: str
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    attention_backend: str
    device: str
    dtype: str
    num_prefill_tokens: int
    num_decode_tokens: int
    offload: str
    blocks_saved: int
    blocks_loaded: int
    failed_loads: int
    bytes_moved: int
    tier_errors: int
    offload_capacity_blocks: int
    offload_redis_url: str
    model_id: str
    block_bytes: int
    epoch: str
    swap_capacity_blocks: int
    prefill_tokens_per_s: float
    copy_bytes_per_s: float
    kv_cache_dtype: str
    def __init__(self, model: _Optional[str] = ..., model_dir: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., attention_backend: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., num_prefill_tokens: _Optional[int] = ..., num_decode_tokens: _Optional[int] = ..., offload: _Optional[str] = ..., blocks_saved: _Optional[int] = ..., blocks_loaded: _Optional[int] = ..., failed_loads: _Optional[int] = ..., bytes_moved: _Optional[int] = ..., tier_errors: _Optional[int] = ..., offload_capacity_blocks: _Optional[int] = ..., offload_redis_url: _Optional[str] = ..., model_id: _Optional[str] = ..., block_bytes: _Optional[int] = ..., epoch: _Optional[str] = ..., swap_capacity_blocks: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., copy_bytes_per_s: _Optional[float] = ..., kv_cache_dtype: _Optional[str] = ...) -> None: ...
