"""THE wire schema: every msgspec Struct that crosses a socket.

Rules: add fields only at the end; enums are IntEnum; every top-level message is a tagged
Struct so that each channel decodes a typed union with one decoder. No pickle anywhere.

Names. A client numbers its requests (`seq`) and may label them (`request_id`, never read by
the engine); (client identity, seq) is a request's *route*. The scheduler gives each accepted
request a *handle*, assigned once and never reused, by which workers and detokenizer know it.

Channels (see bus.py for addresses):
  client      -> tokenizer   : ClientRequests      (GenerateRequest, AbortRequest, StatsRequest)
  client      -> detokenizer : ClientControl       (Hello, Ping)
  detokenizer -> client      : ClientOutbound      (DeltaBatch, RequestError, Stats, Pong...)
  tokenizer   -> scheduler   : SchedulerInbound    (AddRequest, AbortRequest, StatsRequest)
  detokenizer -> scheduler   : SchedulerInbound    (StopRequests)
  worker R    -> scheduler   : SchedulerInbound    (StepResult; R: last stage's TP rank 0)
  scheduler   -> detokenizer : DetokenizerInbound  (EngineOutputs, SchedulerStats)
  tokenizer   -> detokenizer : DetokenizerInbound  (RequestError)
  supervisor  -> detokenizer : DetokenizerInbound  (EpochChanged, EngineFailed)
  supervisor  -> scheduler   : SchedulerInbound    (WorkersLost, WorkersReady)
  scheduler   -> worker k    : WorkerInbound       (StepPlan, Shutdown; the scheduler binds)
  actor       -> supervisor  : SupervisorInbound   (supervision_messages.py)
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from pagedserve.actors.pooling_params import PoolingParams as PoolingParams
from pagedserve.actors.sampling_params import SamplingParams as SamplingParams
from pagedserve.actors.sampling_params import StructuredOutputsParams as StructuredOutputsParams

EPOCH_SHIFT = 40  # handles and step ids carry the scheduler's epoch above this bit


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or max_model_len
    ABORT = 2  # aborted by the client (or a disconnect)

    @property
    def openai_name(self) -> str:
        return ("stop", "length", "abort")[self]


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprob of the chosen token, its rank (1 = most likely) and the top-k alternatives."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


class ChatMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (OpenAI's shape)
    tool_call_id: str | None = None  # a tool message: the call it answers


# ---------------------------------------------------------------- client -> tokenizer


class PromptOptions(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How the tokenizer makes a prompt's token ids; vLLM's request fields of these names.
    add_special_tokens: the tokenizer's own (BOS...) around the text; None: yes for a text
    prompt, no for chat messages (their template writes them). Chat only: add_generation_prompt
    opens the assistant's turn; continue_final_message instead leaves the last message open,
    to be continued (not both); chat_template_kwargs: more variables for the template (e.g.
    Qwen3's enable_thinking); tools: the request's tool definitions, which the template may
    describe to the model; checked by chat.check_prompt_options."""

    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] = {}
    tools: list[dict[str, Any]] | None = None  # chat: the request's tools, for the template


class LoRARequest(msgspec.Struct, frozen=True):
    """vLLM's LoRARequest: a LoRA adapter (PEFT's directory format) a request runs with.
    `lora_int_id` (> 0) names it in the engine: one id, one adapter."""

    lora_name: str
    lora_int_id: int
    lora_path: str


class GenerateRequest(msgspec.Struct, tag=True, kw_only=True):
    seq: int  # the client's number for this request (unique per client)
    sampling: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None  # chat: the tokenizer applies the chat template
    # A client resubmitting after an engine restart: the output tokens it already holds. The
    # engine continues after them (or, if the request is still live, re-sends what it has).
    resume_token_ids: list[int] = []
    options: PromptOptions = msgspec.field(default_factory=PromptOptions)
    priority: int = 0  # with scheduling_policy "priority": lower is admitted first
    lora: LoRARequest | None = None  # the adapter it runs with (enable_lora)
    pooling: PoolingParams | None = None  # an embedding: the prompt pooled, no output tokens
    prompt_pair: str | None = None  # a cross-encoder's second text: prompt's pair, one sequence


class AbortRequest(msgspec.Struct, tag=True, kw_only=True):
    seqs: list[int]
    client: bytes = b""  # filled in by the tokenizer (the ROUTER's identity of the sender)


class StatsRequest(msgspec.Struct, tag=True, kw_only=True):
    seq: int
    client: bytes = b""  # filled in by the tokenizer


# ---------------------------------------------------------------- client <-> detokenizer


class Hello(msgspec.Struct, tag=True):
    """A client's first frame to the detokenizer, which answers Welcome."""


class Ping(msgspec.Struct, tag=True):
    """A client's liveness probe; the detokenizer answers Pong."""


class Welcome(msgspec.Struct, tag=True):
    epoch: int  # bumped by the supervisor whenever it restarts an actor
    failure: str = ""  # set when the engine is dead: why (every request gets a 503)


class Pong(msgspec.Struct, tag=True):
    epoch: int
    failure: str = ""


class RequestDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a client receives for a request: new text and tokens. Offsets place them in the
    request's output, so that a delta sent again (after an engine restart) is recognised."""

    seq: int
    text: str = ""
    token_ids: list[int] = []
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    prompt_token_ids: list[int] | None = None  # sent with the first delta only
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first delta)
    token_offset: int = 0  # index of token_ids[0] in the output
    text_offset: int = 0  # index of text[0] in the output text
    request_id: str = ""  # the client's label: filled in by the client, never sent
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # None for token 0; sent once
    embedding: bytes | None = None  # a pooling request's vector (little-endian float32), final


class DeltaBatch(msgspec.Struct, tag=True):
    """Every delta of one engine step for one client, in one frame."""

    deltas: list[RequestDelta]


class RequestError(msgspec.Struct, tag=True, kw_only=True):
    """A request refused (the final message of its route). Also tokenizer -> detokenizer."""

    seq: int
    message: str
    status_code: int = 400
    client: bytes = b""  # the route, for the detokenizer; cleared before the client gets it


# ---------------------------------------------------------------- into the scheduler


class AddRequest(msgspec.Struct, tag=True, kw_only=True):
    client: bytes
    seq: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float = 0.0
    resume_token_ids: list[int] = []  # see GenerateRequest
    priority: int = 0  # see GenerateRequest
    lora: LoRARequest | None = None  # see GenerateRequest
    pooling: PoolingParams | None = None  # see GenerateRequest


class StopRequests(msgspec.Struct, tag=True):
    """The detokenizer found a stop string: it has sent the final delta; stop computing."""

    handles: list[int]


class Route(msgspec.Struct, array_like=True):
    """What the detokenizer needs to stream a request to its client."""

    handle: int
    client: bytes
    seq: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    output_token_ids: list[int]  # generated before this route was sent (a resume or rebuild)
    finish_reason: FinishReason | None = None  # set when re-sending a finished request's route
    stop_reason: int | None = None
    pooled: bytes | None = None  # a finished pooling request's vector (RequestDelta.embedding)


class RequestOutput(msgspec.Struct, array_like=True):
    """Scheduler -> detokenizer, one per request that advanced in a step."""

    handle: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None
    finish_reason: FinishReason | None
    stop_reason: int | None
    num_cached_tokens: int
    output_offset: int  # how many output tokens came before new_token_ids
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with the first output tokens
    pooled: bytes | None = None  # a pooling request's vector, with its final output


class EngineOutputs(msgspec.Struct, tag=True, kw_only=True):
    """Scheduler -> detokenizer, once per step with news. Routes come first: a route for a
    handle the detokenizer does not know starts it (replaying its output tokens so far)."""

    routes: list[Route] = []
    outputs: list[RequestOutput] = []
    errors: list[RequestError] = []


class SchedulerStats(msgspec.Struct, tag=True, kw_only=True):
    seq: int = 0  # the asking client's seq (its route, with `client`)
    client: bytes = b""
    num_running: int = 0
    num_waiting: int = 0
    num_total_blocks: int = 0
    num_free_blocks: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    # speculative decoding (vLLM's spec_decode metrics): steps that verified drafts, draft
    # tokens verified, of those accepted, and tokens emitted by those steps
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_emitted_tokens: int = 0


class EpochChanged(msgspec.Struct, tag=True):
    """Supervisor -> detokenizer: an actor was restarted; clients resubmit what they wait for.
    After a scheduler restart the handles of the old scheduler are gone: the detokenizer
    forgets its streams with a handle below `drop_handles_below`."""

    epoch: int
    drop_handles_below: int = 0


class EngineFailed(msgspec.Struct, tag=True):
    """Supervisor -> detokenizer: the engine cannot be restarted; every route it holds ends
    with this error (503) at once, and it answers every later ping with it."""

    message: str


# ---------------------------------------------------------------- scheduler <-> workers


class NewRequestData(msgspec.Struct, array_like=True):
    """Everything a worker caches of a request it has not seen (new, or resumed after
    preemption): the token history, where the prompt ends, the sampling settings with the
    request's RNG seed, its blocks and the tokens already in the KV cache."""

    handle: int
    token_ids: list[int]  # every token known now: the prompt, plus outputs when resumed
    num_prompt_tokens: int
    sampling: SamplingParams
    seed: int  # the request's counter-based RNG key (its own seed, or one the scheduler drew)
    block_ids: list[int]
    num_computed_tokens: int  # tokens already in the KV cache (prefix-cache hit)
    lora: LoRARequest | None = None  # the adapter it runs with
    pooling: PoolingParams | None = None  # a pooling request: it never samples (worker/pooling.py)


class CachedRequestData(msgspec.Struct, array_like=True):
    """Columnar diff, in flat lists, for the requests already in the worker's persistent batch:
    the plan's first `len(num_computed_tokens)` scheduled requests (a plan schedules them
    before its new requests). Request i's new blocks are the next `num_new_blocks[i]` ids of
    `new_block_ids` (most decodes get none); its new tokens, the same way."""

    num_computed_tokens: list[int] = []
    num_new_blocks: list[int] = []  # blocks appended to each block table this step
    new_block_ids: list[int] = []  # all of them, request after request
    # pipeline parallelism: tokens new to the stages (empty lists without it)
    num_new_tokens: list[int] = []
    new_token_ids: list[int] = []


class StepPlan(msgspec.Struct, tag=True, kw_only=True):
    """One step for every worker. The batch order is `scheduled`; a request samples a token
    when its scheduled tokens reach the end of the tokens the worker knows for it.

    Speculative decoding: `spec_token_ids[i]` (when given) are draft tokens of scheduled request
    i that follow the tokens the worker knows; they count in num_scheduled_tokens, and the step
    verifies them (the request samples at each of its last 1 + len(drafts) positions)."""

    step_id: int
    new_requests: list[NewRequestData] = []
    cached_requests: CachedRequestData = msgspec.field(default_factory=CachedRequestData)
    scheduled: list[int] = []  # handles
    num_scheduled_tokens: list[int] = []
    finished: list[int] = []  # handles to drop from the persistent batch before this step
    spec_token_ids: list[list[int]] = []  # per scheduled request (empty: no speculation)
    propose: bool = False  # the workers propose drafts for the next step (speculative decoding)
    # The first plan of a scheduler, or the first after the workers were restarted: the worker
    # drops every request and step it holds first, and ignores plans until it sees one.
    reset: bool = False


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of a request's prompt tokens start, start + 1, ... (a step's prompt chunk)."""

    handle: int
    start: int  # index in the prompt of the token logprobs[0] is for (>= 1)
    logprobs: list[TokenLogprobs]


class StepResult(msgspec.Struct, tag=True, kw_only=True):
    step_id: int
    handles: list[int]  # the requests that sampled a token this step, batch order
    sampled_token_ids: list[int]  # their tokens: num_sampled[i] each (one each when empty)
    logprobs: list[TokenLogprobs | None] | None = None  # per sampled token, None if not asked
    num_sampled: list[int] = []  # speculative decoding: tokens each request emitted this step
    # speculative decoding with rounds (SpeculativeConfig.num_rounds): per request, its
    # verifies this step; each verify's drafts and emitted tokens, request after request
    # (empty: one verify of its plan's drafts)
    num_verifies: list[int] = []
    verify_drafts: list[int] = []
    verify_emitted: list[int] = []
    draft_token_ids: list[list[int]] = []  # proposals for each request's next step
    prompt_logprobs: list[PromptLogprobs] = []  # chunks of prompts computed this step
    grammar_done: list[int] = []  # requests whose structured output these tokens complete
    pooled: dict[int, bytes] = {}  # pooling requests whose prompt ends this step: their vectors


class Shutdown(msgspec.Struct, tag=True):
    reason: str = ""


class WorkersLost(msgspec.Struct, tag=True):
    """Supervisor -> scheduler: a worker died (or hung) and every worker is being restarted;
    the steps in flight are lost. The scheduler takes every running request back to waiting
    and plans nothing until WorkersReady."""

    epoch: int


class WorkersReady(msgspec.Struct, tag=True):
    """Supervisor -> scheduler: the restarted workers are ready; the next plan resets them."""

    epoch: int


# ---------------------------------------------------------------- actors -> supervisor


class ActorReady(msgspec.Struct, tag=True, kw_only=True):
    name: str
    pid: int
    num_kv_blocks: int = 0  # workers report how many KV blocks fit in their memory
    setup_s: dict[str, float] = {}  # seconds of each phase of the actor's setup


class ActorFailed(msgspec.Struct, tag=True):
    name: str
    error: str
    # the reporting process: the supervisor ignores the report of one it no longer runs as
    # `name` (a process killed for a restart may report late)
    pid: int


ClientRequests = GenerateRequest | AbortRequest | StatsRequest
ClientControl = Hello | Ping
ClientOutbound = DeltaBatch | RequestError | SchedulerStats | Welcome | Pong
SchedulerInbound = (
    AddRequest | AbortRequest | StatsRequest | StopRequests | StepResult | Shutdown
    | WorkersLost | WorkersReady
)  # fmt: skip
DetokenizerInbound = (
    EngineOutputs | SchedulerStats | RequestError | EpochChanged | EngineFailed | Shutdown
)  # fmt: skip
WorkerInbound = StepPlan | Shutdown
