"""Offline batch generation: `LLM(model).generate(prompts, SamplingParams(...))`, embeddings:
`LLM(model).embed(prompts, PoolingParams(...))`, scores of text pairs (from embeddings, or a
sequence classifier's of each pair): `LLM(model).score(query, documents)`, and a sequence
classifier's classifications: `LLM(model).classify(prompts)`.

It starts the same actor processes as the server (tokenizer, scheduler, workers), submits every
prompt at once through the ZeroMQ client and gathers the streamed deltas into vLLM-shaped
`RequestOutput`s (`EmbeddingRequestOutput`s, `ClassificationRequestOutput`s,
`ScoringRequestOutput`s), in prompt order.
"""

from __future__ import annotations

import atexit
import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from tqdm import tqdm

from pagedserve.actors.chat import check_prompt_options, eos_token_ids, load_tokenizer
from pagedserve.actors.messages import (
    ChatMessage,
    LoRARequest,
    PoolingParams,
    PromptOptions,
    RequestDelta,
    RequestError,
    SamplingParams,
)
from pagedserve.actors.pooling_params import pooling_sampling
from pagedserve.actors.supervisor import EngineDeadError, Supervisor
from pagedserve.api.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    Candidates,
)
from pagedserve.api.classification import Classifier
from pagedserve.api.client import Client
from pagedserve.api.client_core import EngineRequestError, Prompt, fan_out
from pagedserve.api.preflight import prepare_config
from pagedserve.api.sampling_defaults import sampling_defaults
from pagedserve.api.scoring import TextPrompt, plan_scores
from pagedserve.config import DEFAULT_MODEL, EngineConfig, read_hf_config
from pagedserve.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
    embedding_floats,
    prompt_logprob_dicts,
)

PromptInput = str | list[int] | dict[str, Any]
T = TypeVar("T")
POLL_MS = 500


class _Job(NamedTuple):
    """One engine request of a generate call."""

    priority: int
    place: tuple[int, int]  # (prompt index, choice index): where its output goes
    prompt: Prompt
    sampling: SamplingParams
    label: str
    lora: LoRARequest | None
    pooling: PoolingParams | None = None  # an embedding of the prompt


Fold = Callable[[RequestDelta, tuple[int, int]], None]  # a delta into its place's result


@dataclass
class _Pooled:
    """One prompt's pooled vector (engine's wire form: little-endian float32 bytes)."""

    request_id: str
    prompt_token_ids: list[int] = field(default_factory=list)
    vector: bytes = b""


class LLM:
    """Keyword arguments are EngineConfig fields, named like the CLI flags and vLLM's
    (`tensor_parallel_size`, `max_model_len`, `block_size`, `max_num_seqs`, `enforce_eager`,
    `enable_prefix_caching`, `generation_config`, `trust_remote_code`, `chat_template`, ...).
    A setting that cannot work (a model without a tokenizer, say) is a ValueError here,
    before any process starts."""

    def __init__(self, model: str = DEFAULT_MODEL, **engine_args: Any) -> None:
        self.config = prepare_config(EngineConfig(model=model, **engine_args))
        self.default_sampling_params = SamplingParams(**sampling_defaults(self.config))
        self.supervisor = Supervisor(self.config)
        self.supervisor.start()
        self.client = Client(
            self.supervisor.addresses.engine_address,
            credentials=self.supervisor.credentials.for_clients(),
        )
        self._request_counter = itertools.count()
        atexit.register(self.shutdown)

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.generate; `priority` (one per prompt, lower first) needs the engine's
        scheduling_policy "priority"; `lora_request` (one, or one per prompt) needs
        enable_lora."""
        items = [_to_prompt(p) for p in _as_list(prompts)]
        if priority is not None and len(priority) != len(items):
            raise ValueError(f"priority has {len(priority)} entries for {len(items)} prompts")
        loras = _per_prompt(lora_request, len(items), (LoRARequest, type(None)))
        return self._run(items, sampling_params, use_tqdm, PromptOptions(), priority, loras)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: each conversation through the chat template (PromptOptions says
        what the template options do); `lora_request` as generate's."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        items: list[tuple[str | None, Prompt]] = [
            (None, [ChatMessage(m["role"], m["content"]) for m in conv])  # type: ignore[index]
            for conv in conversations
        ]
        options = PromptOptions(
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs or {},
        )
        check_prompt_options(options)
        loras = _per_prompt(lora_request, len(items), (LoRARequest, type(None)))
        return self._run(items, sampling_params, use_tqdm, options, loras=loras)

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's LLM.embed: each prompt's final hidden states pooled into one vector as the
        engine's pooler_config says (PoolingParams: `dimensions`, `normalize`), in prompt
        order; `truncate_prompt_tokens` keeps the prompts' last k tokens (-1: what fits);
        `lora_request` as generate's."""
        items = [_to_prompt(p) for p in _as_list(prompts)]
        pooling = _per_prompt(pooling_params or PoolingParams(), len(items), PoolingParams)
        pooled = self._pool(items, pooling, truncate_prompt_tokens, use_tqdm, lora_request, "embed")
        return [
            EmbeddingRequestOutput(
                result.request_id,
                EmbeddingOutput(embedding_floats(result.vector)),
                result.prompt_token_ids,
                finished=True,
            )
            for result in pooled
        ]

    def classify(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """vLLM's LLM.classify, for a sequence-classification model: each prompt's labels'
        probabilities (`.outputs.probs`, in label order: a softmax of the score head's logits
        over the prompt's last token; a sigmoid for one label), in prompt order. Other
        arguments as embed's; a model without a classification head is a ValueError."""
        items = [_to_prompt(p) for p in _as_list(prompts)]
        pooling = [PoolingParams(task="classify")] * len(items)
        pooled = self._pool(
            items, pooling, truncate_prompt_tokens, use_tqdm, lora_request, "classify"
        )
        classifier = Classifier.of(self._model_config)
        return [
            ClassificationRequestOutput(
                result.request_id,
                ClassificationOutput(classifier.probabilities(result.vector)),
                result.prompt_token_ids,
                finished=True,
            )
            for result in pooled
        ]

    def _pool(
        self,
        items: list[tuple[str | None, Prompt]],
        pooling: list[PoolingParams],
        truncate_prompt_tokens: int | None,
        use_tqdm: bool,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
        desc: str,
    ) -> list[_Pooled]:
        """Each prompt's pooled vector (pooling requests), in prompt order; `desc` names the
        progress bar."""
        loras = _per_prompt(lora_request, len(items), (LoRARequest, type(None)))
        sampling = pooling_sampling(truncate_prompt_tokens)
        results = [_Pooled(str(next(self._request_counter))) for _ in items]
        jobs = [
            _Job(0, (index, 0), prompt, sampling, results[index].request_id, loras[index],
                 pooling[index])
            for index, (_, prompt) in enumerate(items)
        ]  # fmt: skip
        bar = tqdm(total=len(results), desc=desc, disable=not use_tqdm or len(items) < 16)

        def fold(delta: RequestDelta, place: tuple[int, int]) -> None:
            result = results[place[0]]
            if delta.prompt_token_ids is not None:
                result.prompt_token_ids = delta.prompt_token_ids
            if delta.embedding is not None:  # its one delta, the final one
                result.vector = delta.embedding
                bar.update(1)

        with bar:
            self._drive(jobs[::-1], PromptOptions(), fold)
        return results

    def score(
        self,
        data_1: PromptInput | Sequence[PromptInput],
        data_2: PromptInput | Sequence[PromptInput],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score: the score of data_1 (one text or token-id list) and each of
        data_2 (1 -> N), or of data_1[i] and data_2[i] (N -> N), in data_2's order. An
        embedding model's is the cosine similarity of the two embeddings (each distinct text
        embedded once); a sequence classifier's (a cross-encoder of one label) the sigmoid of
        the head's logit of the pair as one sequence (two texts as the tokenizer encodes a text
        pair, two token-id lists joined). `truncate_prompt_tokens` as embed's (of the pair's
        sequence for a cross-encoder); `lora_request`: one adapter for every text."""
        plan = plan_scores(
            _text_prompts(data_1), _text_prompts(data_2), ("data_1", "data_2"),
            self._model_config,
        )  # fmt: skip
        items: list[tuple[str | None, Prompt]] = [(None, prompt) for prompt in plan.prompts]
        pooling = [plan.pooling()] * len(items)
        pooled = self._pool(items, pooling, truncate_prompt_tokens, use_tqdm, lora_request, "score")
        scores = plan.scores([result.vector for result in pooled])
        return [
            ScoringRequestOutput(
                "_".join(pooled[index].request_id for index in pair),
                ScoringOutput(score),
                [token for index in pair for token in pooled[index].prompt_token_ids],
                finished=True,
            )
            for pair, score in zip(plan.pairs, scores)
        ]

    def beam_search(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search (api/beam_search.py): each prompt's beam_width best beams,
        best first, their tokens counting the prompt's and their text the output's."""
        items = [_to_prompt(p) for p in _as_list(prompts)]
        lora = [lora_request] * len(items)
        config = self.supervisor.sized_config
        assert config.max_model_len is not None
        searches = [BeamSearch(params, self._eos_token_ids, config.max_model_len) for _ in items]
        step = params.step_sampling()
        firsts = self._run(items, step, use_tqdm, PromptOptions(), loras=lora)
        for search, output in zip(searches, firsts):
            search.start(output.prompt_token_ids, _step_candidates(output))
        while live := [search for search in searches if not search.done]:
            beams = [(None, list(beam.tokens)) for search in live for beam in search.live]
            loras = [lora_request] * len(beams)
            outputs = iter(self._run(beams, step, False, PromptOptions(), loras=loras))  # type: ignore[arg-type]
            for search in live:
                search.advance([_step_candidates(next(outputs)) for _ in search.live])
        results = []
        for search in searches:
            best = search.best()
            for beam in best:
                beam.text = self._text_of(search.text_ids(beam))
            results.append(BeamSearchOutput(best))
        return results

    @functools.cached_property
    def _tokenizer(self) -> Any:
        """The model's tokenizer in this process (beam texts); None with skip_tokenizer_init."""
        if self.config.skip_tokenizer_init:
            return None
        return load_tokenizer(
            self.config.tokenizer_path,
            self.config.chat_template,
            use_fast=self.config.tokenizer_mode != "slow",
        )

    @functools.cached_property
    def _model_config(self) -> dict[str, Any]:
        """The model's config.json (with hf_overrides)."""
        return read_hf_config(self.config.model_path, self.config.hf_overrides)

    @functools.cached_property
    def _eos_token_ids(self) -> list[int]:
        return eos_token_ids(self.config.model_path, self._tokenizer)

    def _text_of(self, token_ids: list[int]) -> str | None:
        tokenizer = self._tokenizer
        return None if tokenizer is None else tokenizer.decode(token_ids)

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no SamplingParams: vLLM's defaults,
        with the model's generation config over them (see `generation_config`)."""
        return self.default_sampling_params

    def get_stats(self):  # -> SchedulerStats
        return self.client.stats()

    def _run(
        self,
        items: list[tuple[str | None, Prompt]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        options: PromptOptions,
        priority: list[int] | None = None,
        loras: list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.default_sampling_params
        params = _per_prompt(sampling_params, len(items), SamplingParams)
        count = len(items)
        results, jobs = self._plan(items, params, priority or [0] * count, loras or [None] * count)
        bar = tqdm(total=len(results), desc="generate", disable=not use_tqdm or len(items) < 16)

        def fold(delta: RequestDelta, place: tuple[int, int]) -> None:
            if self._fold(delta, results[place[0]], place[1]):
                bar.update(1)

        with bar:
            self._drive(jobs, options, fold)
        return results

    def _drive(self, jobs: list[_Job], options: PromptOptions, fold: Fold) -> None:
        """Send the jobs (last first), as many at once as the window allows, and fold each
        delta into its place until every one has finished; an engine error is raised (and
        every request still running aborted)."""
        owners: dict[int, tuple[int, int]] = {}  # engine request (seq) -> its place
        try:
            while jobs or owners:
                while jobs and len(owners) < self._window:  # within the engine's queue limit
                    job = jobs.pop()
                    seq = self.client.submit(
                        job.prompt, job.sampling, job.label, options, job.priority, job.lora,
                        job.pooling,
                    )  # fmt: skip
                    owners[seq] = job.place
                message = self._next_message()
                if message.seq not in owners:
                    continue
                if isinstance(message, RequestError):
                    raise EngineRequestError(message.message, message.status_code)
                fold(message, owners[message.seq])
                if message.finish_reason is not None:
                    del owners[message.seq]
        except BaseException:
            self.client.abort_seqs(list(owners))
            raise

    @property
    def _window(self) -> int:
        """Engine requests in flight at once: the running set and as many waiting, within the
        engine's admission limit (offline generation never meets a 503)."""
        config = self.supervisor.sized_config
        window = 2 * config.max_num_seqs
        return min(window, config.max_waiting_requests or window)

    def _plan(
        self,
        items: list[tuple[str | None, Prompt]],
        params: list[SamplingParams],
        priority: list[int],
        loras: list[LoRARequest | None],
    ) -> tuple[list[RequestOutput], list[_Job]]:
        """The results to fill, and the engine requests to send (last first; by priority, then
        in order): n > 1 fans out."""
        results: list[RequestOutput] = []
        jobs = []
        for index, ((text, prompt), sampling) in enumerate(zip(items, params)):
            request_id = str(next(self._request_counter))
            children = fan_out(sampling)
            outputs = [CompletionOutput(index=i) for i in range(len(children))]
            results.append(RequestOutput(request_id, text, [], outputs))
            jobs += [
                _Job(priority[index], (index, i), prompt, child, request_id, loras[index])
                for i, child in enumerate(children)
            ]
        jobs.sort(key=lambda job: (job.priority, job.place))
        return results, jobs[::-1]

    def _next_message(self) -> RequestDelta | RequestError:
        while True:
            if self.supervisor.dead_reason is not None:
                raise EngineDeadError(self.supervisor.dead_reason)
            message = self.client.receive(POLL_MS)
            if isinstance(message, (RequestDelta, RequestError)):
                return message

    @staticmethod
    def _fold(delta: RequestDelta, result: RequestOutput, child: int) -> bool:
        """Fold one delta into its result (choice `child`); whether it finished the result."""
        if delta.prompt_token_ids is not None:
            result.prompt_token_ids = delta.prompt_token_ids
            result.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            result.prompt_logprobs = prompt_logprob_dicts(delta.prompt_logprobs)
        result.outputs[child].add(delta)
        return delta.finish_reason is not None and result.finished

    def shutdown(self) -> None:
        if getattr(self, "client", None) is not None:
            self.client.close()
            self.client = None  # type: ignore[assignment]
        if getattr(self, "supervisor", None) is not None:
            self.supervisor.stop()
        atexit.unregister(self.shutdown)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass


def _as_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt given as token ids
    return list(prompts)  # type: ignore[arg-type]


def _to_prompt(prompt: PromptInput) -> tuple[str | None, Prompt]:
    if isinstance(prompt, str):
        return prompt, prompt
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return None, list(prompt["prompt_token_ids"])
        return prompt["prompt"], prompt["prompt"]
    return None, list(prompt)


def _text_prompts(prompts: PromptInput | Sequence[PromptInput]) -> list[TextPrompt]:
    return [prompt for _, prompt in map(_to_prompt, _as_list(prompts))]  # type: ignore[misc]


def _step_candidates(output: RequestOutput) -> Candidates:
    """A beam search step's next tokens: the logprobs of its one output token."""
    logprobs = output.outputs[0].logprobs
    assert logprobs, "a beam search step asks for logprobs"
    return logprobs[0]


def _per_prompt(value: T | Sequence[T], count: int, single: type | tuple[type, ...]) -> list[T]:
    """One value for every prompt, or one per prompt (`single`: the types of one value)."""
    if isinstance(value, single):
        return [value] * count  # type: ignore[list-item]
    if len(value) != count:  # type: ignore[arg-type]
        raise ValueError("give one value, or one per prompt")
    return list(value)  # type: ignore[arg-type]
