# Generated from protos/ by `make proto`. DO NOT EDIT.
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_NEW: _ClassVar[WorkerState]
    WORKER_STATE_DEVICE_READY: _ClassVar[WorkerState]
    WORKER_STATE_MODEL_LOADED: _ClassVar[WorkerState]
    WORKER_STATE_MEMORY_PROFILED: _ClassVar[WorkerState]
    WORKER_STATE_READY: _ClassVar[WorkerState]
    WORKER_STATE_SERVING: _ClassVar[WorkerState]
    WORKER_STATE_SLEEPING: _ClassVar[WorkerState]
    WORKER_STATE_DRAINING: _ClassVar[WorkerState]
    WORKER_STATE_STOPPED: _ClassVar[WorkerState]

class DeviceKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEVICE_KIND_UNSPECIFIED: _ClassVar[DeviceKind]
    DEVICE_KIND_CPU: _ClassVar[DeviceKind]
    DEVICE_KIND_GPU: _ClassVar[DeviceKind]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORTED: _ClassVar[FinishReason]
    FINISH_REASON_STOP_STRING: _ClassVar[FinishReason]
    FINISH_REASON_GRAMMAR_COMPLETE: _ClassVar[FinishReason]

class Parallelism(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PARALLELISM_UNSPECIFIED: _ClassVar[Parallelism]
    PARALLELISM_NONE: _ClassVar[Parallelism]
    PARALLELISM_TENSOR: _ClassVar[Parallelism]
    PARALLELISM_PIPELINE: _ClassVar[Parallelism]

class ProfileSort(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROFILE_SORT_UNSPECIFIED: _ClassVar[ProfileSort]
    PROFILE_SORT_CUMULATIVE: _ClassVar[ProfileSort]
    PROFILE_SORT_OWN: _ClassVar[ProfileSort]
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_NEW: WorkerState
WORKER_STATE_DEVICE_READY: WorkerState
WORKER_STATE_MODEL_LOADED: WorkerState
WORKER_STATE_MEMORY_PROFILED: WorkerState
WORKER_STATE_READY: WorkerState
WORKER_STATE_SERVING: WorkerState
WORKER_STATE_SLEEPING: WorkerState
WORKER_STATE_DRAINING: WorkerState
WORKER_STATE_STOPPED: WorkerState
DEVICE_KIND_UNSPECIFIED: DeviceKind
DEVICE_KIND_CPU: DeviceKind
DEVICE_KIND_GPU: DeviceKind
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP_TOKEN: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CONTEXT_LENGTH: FinishReason
FINISH_REASON_ABORTED: FinishReason
FINISH_REASON_STOP_STRING: FinishReason
FINISH_REASON_GRAMMAR_COMPLETE: FinishReason
PARALLELISM_UNSPECIFIED: Parallelism
PARALLELISM_NONE: Parallelism
PARALLELISM_TENSOR: Parallelism
PARALLELISM_PIPELINE: Parallelism
PROFILE_SORT_UNSPECIFIED: ProfileSort
PROFILE_SORT_CUMULATIVE: ProfileSort
PROFILE_SORT_OWN: ProfileSort

class InitDeviceRequest(_message.Message):
    __slots__ = ("device", "rank", "local_rank", "world_size", "distributed_init_method")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTED_INIT_METHOD_FIELD_NUMBER: _ClassVar[int]
    device: DeviceKind
    rank: int
    local_rank: int
    world_size: int
    distributed_init_method: str
    def __init__(self, device: _Optional[_Union[DeviceKind, str]] = ..., rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., world_size: _Optional[int] = ..., distributed_init_method: _Optional[str] = ...) -> None: ...

class GroupRank(_message.Message):
    __slots__ = ("rank", "host", "local_rank", "pid", "device_name", "total_memory_bytes", "recommended_working_set_bytes", "weight_bytes")
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECOMMENDED_WORKING_SET_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    host: str
    local_rank: int
    pid: int
    device_name: str
    total_memory_bytes: int
    recommended_working_set_bytes: int
    weight_bytes: int
    def __init__(self, rank: _Optional[int] = ..., host: _Optional[str] = ..., local_rank: _Optional[int] = ..., pid: _Optional[int] = ..., device_name: _Optional[str] = ..., total_memory_bytes: _Optional[int] = ..., recommended_working_set_bytes: _Optional[int] = ..., weight_bytes: _Optional[int] = ...) -> None: ...

class DeviceInfo(_message.Message):
    __slots__ = ("kind", "name", "total_memory_bytes", "recommended_working_set_bytes", "mlx_version", "mlx_lm_version", "platform", "rank", "local_rank", "world_size", "backend", "ranks")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECOMMENDED_WORKING_SET_BYTES_FIELD_NUMBER: _ClassVar[int]
    MLX_VERSION_FIELD_NUMBER: _ClassVar[int]
    MLX_LM_VERSION_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    kind: DeviceKind
    name: str
    total_memory_bytes: int
    recommended_working_set_bytes: int
    mlx_version: str
    mlx_lm_version: str
    platform: str
    rank: int
    local_rank: int
    world_size: int
    backend: str
    ranks: _containers.RepeatedCompositeFieldContainer[GroupRank]
    def __init__(self, kind: _Optional[_Union[DeviceKind, str]] = ..., name: _Optional[str] = ..., total_memory_bytes: _Optional[int] = ..., recommended_working_set_bytes: _Optional[int] = ..., mlx_version: _Optional[str] = ..., mlx_lm_version: _Optional[str] = ..., platform: _Optional[str] = ..., rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., world_size: _Optional[int] = ..., backend: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[GroupRank, _Mapping]]] = ...) -> None: ...

class InitDeviceResponse(_message.Message):
    __slots__ = ("device", "state")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    device: DeviceInfo
    state: WorkerState
    def __init__(self, device: _Optional[_Union[DeviceInfo, _Mapping]] = ..., state: _Optional[_Union[WorkerState, str]] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("model", "adapter_path", "max_model_len", "revision", "trust_remote_code")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_PATH_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    TRUST_REMOTE_CODE_FIELD_NUMBER: _ClassVar[int]
    model: str
    adapter_path: str
    max_model_len: int
    revision: str
    trust_remote_code: bool
    def __init__(self, model: _Optional[str] = ..., adapter_path: _Optional[str] = ..., max_model_len: _Optional[int] = ..., revision: _Optional[str] = ..., trust_remote_code: _Optional[bool] = ...) -> None: ...

class Quantization(_message.Message):
    __slots__ = ("bits", "group_size", "mode")
    BITS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    bits: int
    group_size: int
    mode: str
    def __init__(self, bits: _Optional[int] = ..., group_size: _Optional[int] = ..., mode: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "model_path", "model_type", "vocab_size", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "hidden_size", "max_context_length", "eos_token_ids", "bos_token_id", "quantization", "weight_bytes", "dtype", "has_chat_template", "adapter_path", "parallelism")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_PATH_FIELD_NUMBER: _ClassVar[int]
    PARALLELISM_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_path: str
    model_type: str
    vocab_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    max_context_length: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    quantization: Quantization
    weight_bytes: int
    dtype: str
    has_chat_template: bool
    adapter_path: str
    parallelism: Parallelism
    def __init__(self, model: _Optional[str] = ..., model_path: _Optional[str] = ..., model_type: _Optional[str] = ..., vocab_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_attention_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., hidden_size: _Optional[int] = ..., max_context_length: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., quantization: _Optional[_Union[Quantization, _Mapping]] = ..., weight_bytes: _Optional[int] = ..., dtype: _Optional[str] = ..., has_chat_template: _Optional[bool] = ..., adapter_path: _Optional[str] = ..., parallelism: _Optional[_Union[Parallelism, str]] = ...) -> None: ...

class LoadModelResponse(_message.Message):
    __slots__ = ("model", "worker_epoch", "load_seconds", "state")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WORKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    model: ModelInfo
    worker_epoch: int
    load_seconds: float
    state: WorkerState
    def __init__(self, model: _Optional[_Union[ModelInfo, _Mapping]] = ..., worker_epoch: _Optional[int] = ..., load_seconds: _Optional[float] = ..., state: _Optional[_Union[WorkerState, str]] = ...) -> None: ...

class DetermineMemoryRequest(_message.Message):
    __slots__ = ("memory_utilization", "max_num_batched_tokens", "block_size", "kv_bits", "kv_group_size")
    MEMORY_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BITS_FIELD_NUMBER: _ClassVar[int]
    KV_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    memory_utilization: float
    max_num_batched_tokens: int
    block_size: int
    kv_bits: int
    kv_group_size: int
    def __init__(self, memory_utilization: _Optional[float] = ..., max_num_batched_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_bits: _Optional[int] = ..., kv_group_size: _Optional[int] = ...) -> None: ...

class DetermineMemoryResponse(_message.Message):
    __slots__ = ("total_memory_bytes", "recommended_working_set_bytes", "weight_bytes", "activation_peak_bytes", "available_kv_bytes", "bytes_per_block", "block_size", "suggested_num_blocks", "state", "kv_bits", "kv_group_size", "adapter_bytes")
    TOTAL_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECOMMENDED_WORKING_SET_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SUGGESTED_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    KV_BITS_FIELD_NUMBER: _ClassVar[int]
    KV_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_BYTES_FIELD_NUMBER: _ClassVar[int]
    total_memory_bytes: int
    recommended_working_set_bytes: int
    weight_bytes: int
    activation_peak_bytes: int
    available_kv_bytes: int
    bytes_per_block: int
    block_size: int
    suggested_num_blocks: int
    state: WorkerState
    kv_bits: int
    kv_group_size: int
    adapter_bytes: int
    def __init__(self, total_memory_bytes: _Optional[int] = ..., recommended_working_set_bytes: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., activation_peak_bytes: _Optional[int] = ..., available_kv_bytes: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., block_size: _Optional[int] = ..., suggested_num_blocks: _Optional[int] = ..., state: _Optional[_Union[WorkerState, str]] = ..., kv_bits: _Optional[int] = ..., kv_group_size: _Optional[int] = ..., adapter_bytes: _Optional[int] = ...) -> None: ...

class InitCacheRequest(_message.Message):
    __slots__ = ("num_blocks", "block_size", "enable_prefix_caching", "memory_limit_bytes", "kv_bits", "kv_group_size")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BITS_FIELD_NUMBER: _ClassVar[int]
    KV_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool
    memory_limit_bytes: int
    kv_bits: int
    kv_group_size: int
    def __init__(self, num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., enable_prefix_caching: _Optional[bool] = ..., memory_limit_bytes: _Optional[int] = ..., kv_bits: _Optional[int] = ..., kv_group_size: _Optional[int] = ...) -> None: ...

class InitCacheResponse(_message.Message):
    __slots__ = ("num_blocks", "block_size", "max_kv_tokens", "state", "prefix_caching", "memory_limit_bytes", "kv_bits", "kv_group_size")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BITS_FIELD_NUMBER: _ClassVar[int]
    KV_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_size: int
    max_kv_tokens: int
    state: WorkerState
    prefix_caching: bool
    memory_limit_bytes: int
    kv_bits: int
    kv_group_size: int
    def __init__(self, num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., max_kv_tokens: _Optional[int] = ..., state: _Optional[_Union[WorkerState, str]] = ..., prefix_caching: _Optional[bool] = ..., memory_limit_bytes: _Optional[int] = ..., kv_bits: _Optional[int] = ..., kv_group_size: _Optional[int] = ...) -> None: ...

class WarmUpRequest(_message.Message):
    __slots__ = ("batch_sizes", "prefill_lengths")
    BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    prefill_lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batch_sizes: _Optional[_Iterable[int]] = ..., prefill_lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class WarmUpResponse(_message.Message):
    __slots__ = ("shapes_run", "seconds", "state")
    SHAPES_RUN_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    shapes_run: int
    seconds: float
    state: WorkerState
    def __init__(self, shapes_run: _Optional[int] = ..., seconds: _Optional[float] = ..., state: _Optional[_Union[WorkerState, str]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "seed", "min_tokens", "max_tokens", "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "stop", "structured_outputs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    seed: int
    min_tokens: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    prompt_logprobs: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    structured_outputs: StructuredOutputs
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., seed: _Optional[int] = ..., min_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "lark_grammar", "gbnf_grammar", "disable_any_whitespace")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    LARK_GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    GBNF_GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    DISABLE_ANY_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: StructuredChoice
    lark_grammar: str
    gbnf_grammar: str
    disable_any_whitespace: bool
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[StructuredChoice, _Mapping]] = ..., lark_grammar: _Optional[str] = ..., gbnf_grammar: _Optional[str] = ..., disable_any_whitespace: _Optional[bool] = ...) -> None: ...

class StructuredChoice(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("req_id", "prompt_token_ids", "sampling_params", "num_generated_tokens", "lora_name", "detokenize", "skip_special_tokens")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    DETOKENIZE_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: SamplingParams
    num_generated_tokens: int
    lora_name: str
    detokenize: bool
    skip_special_tokens: bool
    def __init__(self, req_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., num_generated_tokens: _Optional[int] = ..., lora_name: _Optional[str] = ..., detokenize: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class CachedRequest(_message.Message):
    __slots__ = ("req_id", "num_computed_tokens", "new_token_ids", "resumed_from_preemption")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FROM_PREEMPTION_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    num_computed_tokens: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    resumed_from_preemption: bool
    def __init__(self, req_id: _Optional[str] = ..., num_computed_tokens: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., resumed_from_preemption: _Optional[bool] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("step_id", "worker_epoch", "new_requests", "cached_requests", "num_scheduled_tokens", "finished_req_ids", "preempted_req_ids", "num_decode_steps", "grammar_bitmask")
    class NumScheduledTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class GrammarBitmaskEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_BITMASK_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    worker_epoch: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    cached_requests: _containers.RepeatedCompositeFieldContainer[CachedRequest]
    num_scheduled_tokens: _containers.ScalarMap[str, int]
    finished_req_ids: _containers.RepeatedScalarFieldContainer[str]
    preempted_req_ids: _containers.RepeatedScalarFieldContainer[str]
    num_decode_steps: int
    grammar_bitmask: _containers.ScalarMap[str, bytes]
    def __init__(self, step_id: _Optional[int] = ..., worker_epoch: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., cached_requests: _Optional[_Iterable[_Union[CachedRequest, _Mapping]]] = ..., num_scheduled_tokens: _Optional[_Mapping[str, int]] = ..., finished_req_ids: _Optional[_Iterable[str]] = ..., preempted_req_ids: _Optional[_Iterable[str]] = ..., num_decode_steps: _Optional[int] = ..., grammar_bitmask: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class RequestOutput(_message.Message):
    __slots__ = ("req_id", "sampled_token_ids", "logprobs", "prompt_logprobs", "num_cached_prompt_tokens", "num_computed_tokens", "finish_reason", "text")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    num_cached_prompt_tokens: int
    num_computed_tokens: int
    finish_reason: FinishReason
    text: str
    def __init__(self, req_id: _Optional[str] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., num_cached_prompt_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., text: _Optional[str] = ...) -> None: ...

class StepTimings(_message.Message):
    __slots__ = ("total_ns", "forward_ns", "num_tokens", "decode_batch_size")
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    total_ns: int
    forward_ns: int
    num_tokens: int
    decode_batch_size: int
    def __init__(self, total_ns: _Optional[int] = ..., forward_ns: _Optional[int] = ..., num_tokens: _Optional[int] = ..., decode_batch_size: _Optional[int] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("step_id", "worker_epoch", "outputs", "timings")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    worker_epoch: int
    outputs: _containers.RepeatedCompositeFieldContainer[RequestOutput]
    timings: StepTimings
    def __init__(self, step_id: _Optional[int] = ..., worker_epoch: _Optional[int] = ..., outputs: _Optional[_Iterable[_Union[RequestOutput, _Mapping]]] = ..., timings: _Optional[_Union[StepTimings, _Mapping]] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ExecuteStreamRequest(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: ExecuteRequest
    def __init__(self, step: _Optional[_Union[ExecuteRequest, _Mapping]] = ...) -> None: ...

class ExecuteStreamResponse(_message.Message):
    __slots__ = ("step_id", "result", "error", "already_finished_req_ids")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ALREADY_FINISHED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    result: ExecuteResponse
    error: StepError
    already_finished_req_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step_id: _Optional[int] = ..., result: _Optional[_Union[ExecuteResponse, _Mapping]] = ..., error: _Optional[_Union[StepError, _Mapping]] = ..., already_finished_req_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class CheckHealthRequest(_message.Message):
    __slots__ = ("deep",)
    DEEP_FIELD_NUMBER: _ClassVar[int]
    deep: bool
    def __init__(self, deep: _Optional[bool] = ...) -> None: ...

class KVUsage(_message.Message):
    __slots__ = ("num_blocks", "used_blocks", "free_blocks", "block_size", "prefix_cache_blocks", "kv_bits", "kv_group_size")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BITS_FIELD_NUMBER: _ClassVar[int]
    KV_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    used_blocks: int
    free_blocks: int
    block_size: int
    prefix_cache_blocks: int
    kv_bits: int
    kv_group_size: int
    def __init__(self, num_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., prefix_cache_blocks: _Optional[int] = ..., kv_bits: _Optional[int] = ..., kv_group_size: _Optional[int] = ...) -> None: ...

class MemoryUsage(_message.Message):
    __slots__ = ("active_bytes", "peak_bytes", "cache_bytes", "limit_bytes")
    ACTIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    active_bytes: int
    peak_bytes: int
    cache_bytes: int
    limit_bytes: int
    def __init__(self, active_bytes: _Optional[int] = ..., peak_bytes: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., limit_bytes: _Optional[int] = ...) -> None: ...

class CheckHealthResponse(_message.Message):
    __slots__ = ("state", "healthy", "num_running_requests", "num_preempted_requests", "kv", "last_error", "worker_epoch", "deep_check_ns", "uptime_seconds", "memory", "bringing_up")
    STATE_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    WORKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    DEEP_CHECK_NS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    BRINGING_UP_FIELD_NUMBER: _ClassVar[int]
    state: WorkerState
    healthy: bool
    num_running_requests: int
    num_preempted_requests: int
    kv: KVUsage
    last_error: str
    worker_epoch: int
    deep_check_ns: int
    uptime_seconds: float
    memory: MemoryUsage
    bringing_up: bool
    def __init__(self, state: _Optional[_Union[WorkerState, str]] = ..., healthy: _Optional[bool] = ..., num_running_requests: _Optional[int] = ..., num_preempted_requests: _Optional[int] = ..., kv: _Optional[_Union[KVUsage, _Mapping]] = ..., last_error: _Optional[str] = ..., worker_epoch: _Optional[int] = ..., deep_check_ns: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., memory: _Optional[_Union[MemoryUsage, _Mapping]] = ..., bringing_up: _Optional[bool] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ("grace_seconds", "abort")
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    grace_seconds: float
    abort: bool
    def __init__(self, grace_seconds: _Optional[float] = ..., abort: _Optional[bool] = ...) -> None: ...

class ShutdownResponse(_message.Message):
    __slots__ = ("state", "num_in_flight")
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    state: WorkerState
    num_in_flight: int
    def __init__(self, state: _Optional[_Union[WorkerState, str]] = ..., num_in_flight: _Optional[int] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("state", "device", "model", "worker_epoch", "kv", "worker_version", "chat_template", "memory", "limits")
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WORKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    WORKER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    state: WorkerState
    device: DeviceInfo
    model: ModelInfo
    worker_epoch: int
    kv: KVUsage
    worker_version: str
    chat_template: str
    memory: MemoryUsage
    limits: WorkerLimits
    def __init__(self, state: _Optional[_Union[WorkerState, str]] = ..., device: _Optional[_Union[DeviceInfo, _Mapping]] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., worker_epoch: _Optional[int] = ..., kv: _Optional[_Union[KVUsage, _Mapping]] = ..., worker_version: _Optional[str] = ..., chat_template: _Optional[str] = ..., memory: _Optional[_Union[MemoryUsage, _Mapping]] = ..., limits: _Optional[_Union[WorkerLimits, _Mapping]] = ...) -> None: ...

class WorkerLimits(_message.Message):
    __slots__ = ("max_running_requests", "max_queued_steps", "max_message_bytes", "max_steps_in_flight")
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    max_running_requests: int
    max_queued_steps: int
    max_message_bytes: int
    max_steps_in_flight: int
    def __init__(self, max_running_requests: _Optional[int] = ..., max_queued_steps: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_steps_in_flight: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls_json", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls_json: str
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls_json: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "messages", "add_special_tokens", "add_generation_prompt", "tools_json")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    text: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_special_tokens: bool
    add_generation_prompt: bool
    tools_json: str
    def __init__(self, text: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_special_tokens: _Optional[bool] = ..., add_generation_prompt: _Optional[bool] = ..., tools_json: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "text")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens", "return_token_bytes")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    return_token_bytes: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ..., return_token_bytes: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text", "token_bytes")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_bytes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, text: _Optional[str] = ..., token_bytes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("level",)
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    level: int
    def __init__(self, level: _Optional[int] = ...) -> None: ...

class SleepResponse(_message.Message):
    __slots__ = ("state", "level", "num_aborted", "freed_bytes", "worker_epoch")
    STATE_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    state: WorkerState
    level: int
    num_aborted: int
    freed_bytes: int
    worker_epoch: int
    def __init__(self, state: _Optional[_Union[WorkerState, str]] = ..., level: _Optional[int] = ..., num_aborted: _Optional[int] = ..., freed_bytes: _Optional[int] = ..., worker_epoch: _Optional[int] = ...) -> None: ...

class WakeUpRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WakeUpResponse(_message.Message):
    __slots__ = ("state", "worker_epoch", "wake_seconds", "dropped_loras")
    STATE_FIELD_NUMBER: _ClassVar[int]
    WORKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    WAKE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_LORAS_FIELD_NUMBER: _ClassVar[int]
    state: WorkerState
    worker_epoch: int
    wake_seconds: float
    dropped_loras: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, state: _Optional[_Union[WorkerState, str]] = ..., worker_epoch: _Optional[int] = ..., wake_seconds: _Optional[float] = ..., dropped_loras: _Optional[_Iterable[str]] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("freed_blocks",)
    FREED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    freed_blocks: int
    def __init__(self, freed_blocks: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "messages", "prompt_token_ids", "sampling_params", "request_id", "skip_special_tokens", "tools_json", "model", "lora_name")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: SamplingParams
    request_id: str
    skip_special_tokens: bool
    tools_json: str
    model: str
    lora_name: str
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., skip_special_tokens: _Optional[bool] = ..., tools_json: _Optional[str] = ..., model: _Optional[str] = ..., lora_name: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "finish_reason", "prompt_tokens", "completion_tokens", "request_id", "num_cached_prompt_tokens", "stop_string")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    request_id: str
    num_cached_prompt_tokens: int
    stop_string: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., request_id: _Optional[str] = ..., num_cached_prompt_tokens: _Optional[int] = ..., stop_string: _Optional[str] = ...) -> None: ...

class AddLoraRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("name", "path", "rank", "scale", "bytes", "pinned", "num_requests", "num_modules", "load_seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_MODULES_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    scale: float
    bytes: int
    pinned: bool
    num_requests: int
    num_modules: int
    load_seconds: float
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., scale: _Optional[float] = ..., bytes: _Optional[int] = ..., pinned: _Optional[bool] = ..., num_requests: _Optional[int] = ..., num_modules: _Optional[int] = ..., load_seconds: _Optional[float] = ...) -> None: ...

class AddLoraResponse(_message.Message):
    __slots__ = ("adapter", "already_loaded", "evicted", "kv")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ALREADY_LOADED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    adapter: LoraAdapter
    already_loaded: bool
    evicted: str
    kv: KVUsage
    def __init__(self, adapter: _Optional[_Union[LoraAdapter, _Mapping]] = ..., already_loaded: _Optional[bool] = ..., evicted: _Optional[str] = ..., kv: _Optional[_Union[KVUsage, _Mapping]] = ...) -> None: ...

class RemoveLoraRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class RemoveLoraResponse(_message.Message):
    __slots__ = ("path", "kv")
    PATH_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    path: str
    kv: KVUsage
    def __init__(self, path: _Optional[str] = ..., kv: _Optional[_Union[KVUsage, _Mapping]] = ...) -> None: ...

class PinLoraRequest(_message.Message):
    __slots__ = ("name", "unpin")
    NAME_FIELD_NUMBER: _ClassVar[int]
    UNPIN_FIELD_NUMBER: _ClassVar[int]
    name: str
    unpin: bool
    def __init__(self, name: _Optional[str] = ..., unpin: _Optional[bool] = ...) -> None: ...

class PinLoraResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: LoraAdapter
    def __init__(self, adapter: _Optional[_Union[LoraAdapter, _Mapping]] = ...) -> None: ...

class ListLorasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLorasResponse(_message.Message):
    __slots__ = ("names", "adapters", "max_loras")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    max_loras: int
    def __init__(self, names: _Optional[_Iterable[str]] = ..., adapters: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ..., max_loras: _Optional[int] = ...) -> None: ...

class StartProfileRequest(_message.Message):
    __slots__ = ("label", "gpu_capture")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    GPU_CAPTURE_FIELD_NUMBER: _ClassVar[int]
    label: str
    gpu_capture: bool
    def __init__(self, label: _Optional[str] = ..., gpu_capture: _Optional[bool] = ...) -> None: ...

class StartProfileResponse(_message.Message):
    __slots__ = ("label", "path", "gpu_capture_path")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    GPU_CAPTURE_PATH_FIELD_NUMBER: _ClassVar[int]
    label: str
    path: str
    gpu_capture_path: str
    def __init__(self, label: _Optional[str] = ..., path: _Optional[str] = ..., gpu_capture_path: _Optional[str] = ...) -> None: ...

class StopProfileRequest(_message.Message):
    __slots__ = ("top_entries", "sort")
    TOP_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    SORT_FIELD_NUMBER: _ClassVar[int]
    top_entries: int
    sort: ProfileSort
    def __init__(self, top_entries: _Optional[int] = ..., sort: _Optional[_Union[ProfileSort, str]] = ...) -> None: ...

class ProfileEntry(_message.Message):
    __slots__ = ("function", "file", "line", "calls", "primitive_calls", "cumulative_seconds", "own_seconds")
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    PRIMITIVE_CALLS_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OWN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    function: str
    file: str
    line: int
    calls: int
    primitive_calls: int
    cumulative_seconds: float
    own_seconds: float
    def __init__(self, function: _Optional[str] = ..., file: _Optional[str] = ..., line: _Optional[int] = ..., calls: _Optional[int] = ..., primitive_calls: _Optional[int] = ..., cumulative_seconds: _Optional[float] = ..., own_seconds: _Optional[float] = ...) -> None: ...

class StopProfileResponse(_message.Message):
    __slots__ = ("label", "path", "gpu_capture_path", "seconds", "entries", "num_functions")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    GPU_CAPTURE_PATH_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NUM_FUNCTIONS_FIELD_NUMBER: _ClassVar[int]
    label: str
    path: str
    gpu_capture_path: str
    seconds: float
    entries: _containers.RepeatedCompositeFieldContainer[ProfileEntry]
    num_functions: int
    def __init__(self, label: _Optional[str] = ..., path: _Optional[str] = ..., gpu_capture_path: _Optional[str] = ..., seconds: _Optional[float] = ..., entries: _Optional[_Iterable[_Union[ProfileEntry, _Mapping]]] = ..., num_functions: _Optional[int] = ...) -> None: ...
