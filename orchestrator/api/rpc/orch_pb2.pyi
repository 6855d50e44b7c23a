from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScaleRequest(_message.Message):
    __slots__ = ("counts",)
    class CountsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    counts: _containers.ScalarMap[str, int]
    def __init__(self, counts: _Optional[_Mapping[str, int]] = ...) -> None: ...

class AddInstanceRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: str
    def __init__(self, role: _Optional[str] = ...) -> None: ...

class RemoveInstanceRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ScaleResponse(_message.Message):
    __slots__ = ("added", "removed", "moved_requests", "counts")
    class CountsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    MOVED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    added: _containers.RepeatedScalarFieldContainer[str]
    removed: _containers.RepeatedScalarFieldContainer[str]
    moved_requests: int
    counts: _containers.ScalarMap[str, int]
    def __init__(self, added: _Optional[_Iterable[str]] = ..., removed: _Optional[_Iterable[str]] = ..., moved_requests: _Optional[int] = ..., counts: _Optional[_Mapping[str, int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "seed", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "stop_token_ids", "logprobs", "grammar", "stop")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    seed: int
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: int
    grammar: Grammar
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[int] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("json_schema", "regex", "lark")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    LARK_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    regex: str
    lark: str
    def __init__(self, json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., lark: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "sampling", "request_id", "n")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    sampling: SamplingParams
    request_id: str
    n: int
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., n: _Optional[int] = ...) -> None: ...

class GenerateStats(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "ttft_s", "tpot_s", "e2e_s", "prefill_instance", "decode_instance", "cached_tokens", "ttft_phases")
    class TtftPhasesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TPOT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_PHASES_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    tpot_s: float
    e2e_s: float
    prefill_instance: str
    decode_instance: str
    cached_tokens: int
    ttft_phases: _containers.ScalarMap[str, float]
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., ttft_s: _Optional[float] = ..., tpot_s: _Optional[float] = ..., e2e_s: _Optional[float] = ..., prefill_instance: _Optional[str] = ..., decode_instance: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., ttft_phases: _Optional[_Mapping[str, float]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "stats", "logprobs", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    stats: GenerateStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    index: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[GenerateStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("rank", "node_id", "device", "pid")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node_id: str
    device: str
    pid: int
    def __init__(self, rank: _Optional[int] = ..., node_id: _Optional[str] = ..., device: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class InstanceStatus(_message.Message):
    __slots__ = ("name", "role", "tp", "ranks", "queue_depth", "running", "free_blocks", "total_blocks", "outstanding_tokens", "kv_bytes_sent", "kv_failures", "health", "detail", "has_load", "step_phases", "cached_blocks", "prefix_hit_tokens", "prefix_queried_tokens", "kv_tail", "spec_acceptance_rate", "spec_mean_accepted_length", "router_outstanding_tokens", "kv_groups", "graph_modes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_FAILURES_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    HAS_LOAD_FIELD_NUMBER: _ClassVar[int]
    STEP_PHASES_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TAIL_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    SPEC_MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ROUTER_OUTSTANDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_GROUPS_FIELD_NUMBER: _ClassVar[int]
    GRAPH_MODES_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: str
    tp: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    queue_depth: int
    running: int
    free_blocks: int
    total_blocks: int
    outstanding_tokens: int
    kv_bytes_sent: int
    kv_failures: int
    health: str
    detail: str
    has_load: bool
    step_phases: _containers.RepeatedCompositeFieldContainer[StepPhase]
    cached_blocks: int
    prefix_hit_tokens: int
    prefix_queried_tokens: int
    kv_tail: KVTail
    spec_acceptance_rate: float
    spec_mean_accepted_length: float
    router_outstanding_tokens: int
    kv_groups: _containers.RepeatedCompositeFieldContainer[KVGroupBlocks]
    graph_modes: _containers.RepeatedCompositeFieldContainer[GraphMode]
    def __init__(self, name: _Optional[str] = ..., role: _Optional[str] = ..., tp: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ..., queue_depth: _Optional[int] = ..., running: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., outstanding_tokens: _Optional[int] = ..., kv_bytes_sent: _Optional[int] = ..., kv_failures: _Optional[int] = ..., health: _Optional[str] = ..., detail: _Optional[str] = ..., has_load: _Optional[bool] = ..., step_phases: _Optional[_Iterable[_Union[StepPhase, _Mapping]]] = ..., cached_blocks: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., prefix_queried_tokens: _Optional[int] = ..., kv_tail: _Optional[_Union[KVTail, _Mapping]] = ..., spec_acceptance_rate: _Optional[float] = ..., spec_mean_accepted_length: _Optional[float] = ..., router_outstanding_tokens: _Optional[int] = ..., kv_groups: _Optional[_Iterable[_Union[KVGroupBlocks, _Mapping]]] = ..., graph_modes: _Optional[_Iterable[_Union[GraphMode, _Mapping]]] = ...) -> None: ...

class GraphMode(_message.Message):
    __slots__ = ("forward", "state")
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    forward: str
    state: str
    def __init__(self, forward: _Optional[str] = ..., state: _Optional[str] = ...) -> None: ...

class KVGroupBlocks(_message.Message):
    __slots__ = ("group", "free_blocks", "total_blocks")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    group: str
    free_blocks: int
    total_blocks: int
    def __init__(self, group: _Optional[str] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ...) -> None: ...

class KVTail(_message.Message):
    __slots__ = ("count", "sum_s", "max_s", "last_s")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SUM_S_FIELD_NUMBER: _ClassVar[int]
    MAX_S_FIELD_NUMBER: _ClassVar[int]
    LAST_S_FIELD_NUMBER: _ClassVar[int]
    count: int
    sum_s: float
    max_s: float
    last_s: float
    def __init__(self, count: _Optional[int] = ..., sum_s: _Optional[float] = ..., max_s: _Optional[float] = ..., last_s: _Optional[float] = ...) -> None: ...

class StepPhase(_message.Message):
    __slots__ = ("phase", "count", "total_s")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    phase: str
    count: int
    total_s: float
    def __init__(self, phase: _Optional[str] = ..., count: _Optional[int] = ..., total_s: _Optional[float] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("instances", "in_flight", "model")
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceStatus]
    in_flight: int
    model: str
    def __init__(self, instances: _Optional[_Iterable[_Union[InstanceStatus, _Mapping]]] = ..., in_flight: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...
