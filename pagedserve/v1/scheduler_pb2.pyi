from pagedserve.v1 import common_pb2 as _common_pb2
from pagedserve.v1 import kvcache_pb2 as _kvcache_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AddRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "output_token_ids", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., priority: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class SchedulerRequest(_message.Message):
    __slots__ = ("add", "abort")
    ADD_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    add: AddRequest
    abort: AbortRequest
    def __init__(self, add: _Optional[_Union[AddRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequest, _Mapping]] = ...) -> None: ...

class RequestOutput(_message.Message):
    __slots__ = ("request_id", "new_token_ids", "logprobs", "finish_reason", "num_prompt_tokens", "num_output_tokens", "error", "prompt_logprobs", "queue_time_s", "prefill_time_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: _common_pb2.FinishReason
    num_prompt_tokens: int
    num_output_tokens: int
    error: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    queue_time_s: float
    prefill_time_s: float
    def __init__(self, request_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., error: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., queue_time_s: _Optional[float] = ..., prefill_time_s: _Optional[float] = ...) -> None: ...

class TokenOutputs(_message.Message):
    __slots__ = ("request_ids", "num_new_tokens", "new_token_ids", "num_prompt_tokens", "num_output_tokens")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_new_tokens: _containers.RepeatedScalarFieldContainer[int]
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_output_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., num_new_tokens: _Optional[_Iterable[int]] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[_Iterable[int]] = ..., num_output_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class SchedulerUpdate(_message.Message):
    __slots__ = ("outputs", "tokens")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[RequestOutput]
    tokens: TokenOutputs
    def __init__(self, outputs: _Optional[_Iterable[_Union[RequestOutput, _Mapping]]] = ..., tokens: _Optional[_Union[TokenOutputs, _Mapping]] = ...) -> None: ...

class SchedulerStatsRequest(_message.Message):
    __slots__ = ("include_kv_cache",)
    INCLUDE_KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    include_kv_cache: bool
    def __init__(self, include_kv_cache: bool = ...) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_steps", "num_preemptions", "kv_rpcs", "kv_calls_skipped", "executor_rpcs", "num_failed_steps", "num_recomputed_tokens", "steps_out_limit", "loop_work_share", "kv_cache")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    KV_RPCS_FIELD_NUMBER: _ClassVar[int]
    KV_CALLS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_RPCS_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_OUT_LIMIT_FIELD_NUMBER: _ClassVar[int]
    LOOP_WORK_SHARE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_steps: int
    num_preemptions: int
    kv_rpcs: int
    kv_calls_skipped: int
    executor_rpcs: int
    num_failed_steps: int
    num_recomputed_tokens: int
    steps_out_limit: int
    loop_work_share: float
    kv_cache: _kvcache_pb2.KVCacheStats
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_steps: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., kv_rpcs: _Optional[int] = ..., kv_calls_skipped: _Optional[int] = ..., executor_rpcs: _Optional[int] = ..., num_failed_steps: _Optional[int] = ..., num_recomputed_tokens: _Optional[int] = ..., steps_out_limit: _Optional[int] = ..., loop_work_share: _Optional[float] = ..., kv_cache: _Optional[_Union[_kvcache_pb2.KVCacheStats, _Mapping]] = ...) -> None: ...

class SchedulerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerInfo(_message.Message):
    __slots__ = ("model", "model_dir", "max_model_len", "vocab_size")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_dir: str
    max_model_len: int
    vocab_size: int
    def __init__(self, model: _Optional[str] = ..., model_dir: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ...) -> None: ...
