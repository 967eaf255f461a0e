from protos.pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "n", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    n: int
    prompt_logprobs: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., n: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class WorkerGenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "usage", "logprobs", "queue_s", "index", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    queue_s: float
    index: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., queue_s: _Optional[float] = ..., index: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class KVTarget(_message.Message):
    __slots__ = ("address", "skip_blocks", "block_ids")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    address: str
    skip_blocks: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, address: _Optional[str] = ..., skip_blocks: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request", "target")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    request: WorkerGenerateRequest
    target: KVTarget
    def __init__(self, request: _Optional[_Union[WorkerGenerateRequest, _Mapping]] = ..., target: _Optional[_Union[KVTarget, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first", "choices")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    first: WorkerGenerateResponse
    choices: _containers.RepeatedCompositeFieldContainer[WorkerGenerateResponse]
    def __init__(self, first: _Optional[_Union[WorkerGenerateResponse, _Mapping]] = ..., choices: _Optional[_Iterable[_Union[WorkerGenerateResponse, _Mapping]]] = ...) -> None: ...

class Reservation(_message.Message):
    __slots__ = ("local", "cached_tokens", "target")
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    local: bool
    cached_tokens: int
    target: KVTarget
    def __init__(self, local: _Optional[bool] = ..., cached_tokens: _Optional[int] = ..., target: _Optional[_Union[KVTarget, _Mapping]] = ...) -> None: ...

class DecodeCommit(_message.Message):
    __slots__ = ("first_token", "choice_tokens")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CHOICE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    choice_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, first_token: _Optional[int] = ..., choice_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("start", "commit")
    START_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    start: WorkerGenerateRequest
    commit: DecodeCommit
    def __init__(self, start: _Optional[_Union[WorkerGenerateRequest, _Mapping]] = ..., commit: _Optional[_Union[DecodeCommit, _Mapping]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("reservation", "output")
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    reservation: Reservation
    output: WorkerGenerateResponse
    def __init__(self, reservation: _Optional[_Union[Reservation, _Mapping]] = ..., output: _Optional[_Union[WorkerGenerateResponse, _Mapping]] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("role", "model", "running_requests", "waiting_requests", "free_blocks", "total_blocks", "max_model_len", "reserved_requests", "transfers", "block_size", "model_id", "prompt_tokens", "cached_prompt_tokens")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    RESERVED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    role: str
    model: str
    running_requests: int
    waiting_requests: int
    free_blocks: int
    total_blocks: int
    max_model_len: int
    reserved_requests: int
    transfers: _common_pb2.TransferStats
    block_size: int
    model_id: str
    prompt_tokens: int
    cached_prompt_tokens: int
    def __init__(self, role: _Optional[str] = ..., model: _Optional[str] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., max_model_len: _Optional[int] = ..., reserved_requests: _Optional[int] = ..., transfers: _Optional[_Union[_common_pb2.TransferStats, _Mapping]] = ..., block_size: _Optional[int] = ..., model_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class SetRoleRequest(_message.Message):
    __slots__ = ("role", "reason", "drain_timeout_s", "prefill_tokens_while_decoding")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_WHILE_DECODING_FIELD_NUMBER: _ClassVar[int]
    role: str
    reason: str
    drain_timeout_s: float
    prefill_tokens_while_decoding: int
    def __init__(self, role: _Optional[str] = ..., reason: _Optional[str] = ..., drain_timeout_s: _Optional[float] = ..., prefill_tokens_while_decoding: _Optional[int] = ...) -> None: ...

class SetRoleResponse(_message.Message):
    __slots__ = ("role", "previous_role", "drained_s", "kv_address", "prefill_tokens_while_decoding")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAINED_S_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_WHILE_DECODING_FIELD_NUMBER: _ClassVar[int]
    role: str
    previous_role: str
    drained_s: float
    kv_address: str
    prefill_tokens_while_decoding: int
    def __init__(self, role: _Optional[str] = ..., previous_role: _Optional[str] = ..., drained_s: _Optional[float] = ..., kv_address: _Optional[str] = ..., prefill_tokens_while_decoding: _Optional[int] = ...) -> None: ...
