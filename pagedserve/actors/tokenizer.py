"""The tokenizer process: the engine's way in. Client requests in, token ids to the scheduler.

Clients send over a DEALER to its ROUTER, which names each sender: (identity, seq) is the
request's route, carried to the scheduler, which owns it from then on. Text is checked against
a size bound before anything is encoded (a prompt whose characters cannot fit max_model_len
tokens is refused at once), small prompts are encoded in the loop, and large ones in worker
threads (the Rust tokenizer's batch encode releases the GIL), so a huge prompt never stalls
the requests behind it. A refusal goes to the detokenizer, the clients' one way out.
"""

from __future__ import annotations

import logging
import time

import anyio

from pagedserve.actors import bus
from pagedserve.actors.actor import Actor
from pagedserve.actors.chat import apply_chat_template, eos_token_ids, load_tokenizer
from pagedserve.actors.grammars import GrammarChecker
from pagedserve.actors.messages import (
    AbortRequest,
    AddRequest,
    ClientRequests,
    DetokenizerInbound,
    GenerateRequest,
    RequestError,
    SchedulerInbound,
)
from pagedserve.config import read_hf_config
from pagedserve.models.lora_format import AdapterChecks
from pagedserve.models.model_config import check_task, load_model_config, uses_sep_token

logger = logging.getLogger(__name__)

INLINE_ENCODE_CHARS = 4096  # prompts up to this size are encoded in the loop
ENCODE_THREADS = 2


class PromptEncoder:
    """Prompt -> validated token ids; every ValueError becomes a 400 for the client."""

    def __init__(
        self,
        tokenizer: object | None,
        vocab_size: int,
        max_model_len: int,
        grammars: GrammarChecker | None = None,
        max_logprobs: int = 20,
        hidden_size: int = 0,
        model_config: dict | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config or {}  # config.json: what tasks the model serves
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.hidden_size = hidden_size  # the most values an embedding has (PoolingParams)
        self.max_logprobs = min(max_logprobs, vocab_size)  # EngineConfig.max_logprobs
        self.max_chars = max_model_len * longest_token_chars(tokenizer)
        self.grammars = grammars  # checks structured outputs (None: no tokenizer)

    def size(self, request: GenerateRequest) -> int:
        """Characters of text to encode (0 for token ids)."""
        if request.messages is not None:
            return sum(len(m.content) + len(m.role) for m in request.messages)
        if request.prompt_token_ids is not None:
            return 0
        return len(request.prompt or "") + len(request.prompt_pair or "")

    def inline(self, request: GenerateRequest) -> bool:
        """Whether to encode it in the loop: a small prompt, and no grammar to validate."""
        structured = request.sampling.structured_outputs is not None
        return not structured and self.size(request) <= INLINE_ENCODE_CHARS

    def check_task(self, request: GenerateRequest) -> None:
        """The model serves what the request asks (a sequence classifier classifies only; a
        causal LM generates and embeds)."""
        task = "generate" if request.pooling is None else request.pooling.task or "embed"
        check_task(self.model_config, task)

    def check_size(self, request: GenerateRequest) -> None:
        """Refuse text that cannot fit max_model_len tokens, before encoding it (unless the
        request truncates its prompt)."""
        if request.sampling.truncate_prompt_tokens is None and self.size(request) > self.max_chars:
            raise ValueError(
                f"the prompt is too long: {self.size(request)} characters cannot fit this "
                f"model's maximum context length of {self.max_model_len} tokens"
            )

    def encode(self, request: GenerateRequest) -> list[int]:
        if self.tokenizer is None and request.prompt_token_ids is None:
            raise ValueError("this engine has no tokenizer (skip_tokenizer_init): send token ids")
        options = request.options
        self.check_pair(request)
        if request.messages is not None:
            ids = apply_chat_template(self.tokenizer, request.messages, options)
        elif request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
        elif request.prompt_pair is not None:
            ids = encode_pair(
                self.tokenizer, (request.prompt or "", request.prompt_pair),
                options.add_special_tokens is not False, uses_sep_token(self.model_config),
            )  # fmt: skip
        elif request.prompt is not None:
            ids = encode_text(
                self.tokenizer, request.prompt, options.add_special_tokens is not False
            )
        else:
            raise ValueError("a request needs a prompt, prompt token ids or chat messages")
        room = 0 if request.pooling is not None else 1  # for output: an embedding has none
        ids = self.truncated(ids, request.sampling.truncate_prompt_tokens, room)
        self.check_ids(ids, request.resume_token_ids, room)
        self.check_dimensions(request)
        self.check_grammar(request)
        self.resolve_bad_words(request)
        self.check_sampling_token_ids(request)
        return ids

    @staticmethod
    def check_pair(request: GenerateRequest) -> None:
        """A text pair (a cross-encoder's score: `prompt_pair`) pairs two texts, and a
        sequence classifier classifies it."""
        if request.prompt_pair is None:
            return
        if request.prompt is None or request.prompt_token_ids is not None or request.messages:
            raise ValueError("prompt_pair pairs with a text prompt, not token ids or messages")
        if request.pooling is None or request.pooling.task != "classify":
            raise ValueError("a text pair is scored by a sequence classifier: task classify")

    def resolve_bad_words(self, request: GenerateRequest) -> None:
        """The bad words' token sequences, as vLLM forms them: each word (leading spaces
        stripped) alone, and with one leading space where that spells it in other tokens of
        the same count (a word-initial token)."""
        sampling = request.sampling
        if not sampling.bad_words:
            return
        if self.tokenizer is None:
            raise ValueError("bad_words need the model's tokenizer (skip_tokenizer_init)")
        sequences: list[list[int]] = []
        for word in sampling.bad_words:
            alone = encode_text(self.tokenizer, word.lstrip(), add_special_tokens=False)
            spaced = encode_text(self.tokenizer, " " + word.lstrip(), add_special_tokens=False)
            if alone:
                sequences.append(alone)
            if alone and len(spaced) == len(alone) and spaced[0] != alone[0]:
                sequences.append(spaced)
        sampling.bad_words_token_ids = sequences

    def truncated(self, ids: list[int], keep: int | None, room: int) -> list[int]:
        """The prompt's last `keep` tokens (-1: max_model_len - room, room for output)."""
        if keep is None:
            return ids
        keep = self.max_model_len - room if keep == -1 else keep
        return ids[-keep:] if keep > 0 else []

    def check_sampling_token_ids(self, request: GenerateRequest) -> None:
        sampling = request.sampling
        if any(not 0 <= t < self.vocab_size for t in sampling.logit_bias or {}):
            raise ValueError(f"logit_bias token ids must be in [0, {self.vocab_size})")
        if any(not 0 <= t < self.vocab_size for t in sampling.allowed_token_ids or []):
            raise ValueError(f"allowed_token_ids must be in [0, {self.vocab_size})")
        for ids in sampling.bad_words_token_ids or []:
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"bad_words_token_ids must be in [0, {self.vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(sampling, name)
            if asked is not None and asked > self.max_logprobs:
                raise ValueError(
                    f"{name}: {asked} asked, the most this engine gives is {self.max_logprobs} "
                    "(--max-logprobs)"
                )

    def check_grammar(self, request: GenerateRequest) -> None:
        structured = request.sampling.structured_outputs
        if structured is None:
            return
        if self.grammars is None:
            raise ValueError("structured outputs need the model's tokenizer (skip_tokenizer_init)")
        self.grammars.check(structured)

    def check_ids(self, ids: list[int], resume_ids: list[int], room: int) -> None:
        """Token ids the model knows, leaving `room` tokens for output within max_model_len."""
        if not ids:
            raise ValueError("the prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in ids + resume_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if len(ids) + room > self.max_model_len:
            rest = ", which leaves no room for output" if room else ""
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {len(ids)} tokens{rest}."
            )

    def check_dimensions(self, request: GenerateRequest) -> None:
        """An embedding keeps at most the model's hidden size of values."""
        dimensions = request.pooling.dimensions if request.pooling is not None else None
        if dimensions is not None and dimensions > self.hidden_size:
            raise ValueError(
                f"dimensions must be at most the model's hidden size, {self.hidden_size}; "
                f"got {dimensions}"
            )


def encode_text(tokenizer: object, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`, with the tokenizer's special tokens (BOS...) unless told not to;
    the Rust tokenizer's batch encode when there is one: unlike its single encode, it
    releases the GIL."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None:
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)  # type: ignore[attr-defined]


def encode_pair(
    tokenizer: object, pair: tuple[str, str], add_special_tokens: bool, with_separator: bool
) -> list[int]:
    """A cross-encoder's text pair as one sequence, as vLLM makes it: the tokenizer's encoding
    of a text pair (each text's tokens, between the special tokens its template puts around
    and between them) for a classifier trained on pairs, else (an LLM as reranker) the two
    texts joined into one and encoded (`uses_sep_token`). An empty second text is no pair, as
    transformers takes it."""
    if not with_separator or not pair[1]:
        return encode_text(tokenizer, pair[0] + pair[1], add_special_tokens)
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None:  # as encode_text: the batch encode releases the GIL
        return backend.encode_batch([pair], add_special_tokens=add_special_tokens)[0].ids
    return tokenizer.encode(*pair, add_special_tokens=add_special_tokens)  # type: ignore[attr-defined]


def longest_token_chars(tokenizer: object | None) -> int:
    """An upper bound on the characters one token stands for (byte-level vocabularies spell
    each byte as one character, so this also bounds UTF-8 bytes)."""
    if tokenizer is None:
        return 1
    vocab = tokenizer.get_vocab()  # type: ignore[attr-defined]
    return max((len(token) for token in vocab), default=1) + 1


class TokenizerActor(Actor):
    name = "tokenizer"

    def prepare(self) -> None:
        tokenizer, grammars = None, None
        model_vocab_size = int(
            read_hf_config(self.config.model_path, self.config.hf_overrides)["vocab_size"]
        )
        if self.config.skip_tokenizer_init:
            vocab_size = model_vocab_size
        else:
            tokenizer = load_tokenizer(
                self.config.tokenizer_path,
                self.config.chat_template,
                use_fast=self.config.tokenizer_mode != "slow",
            )
            vocab_size = min(len(tokenizer), model_vocab_size)  # ids the model can take
        self.eos_token_ids = eos_token_ids(self.config.model_path, tokenizer)
        if tokenizer is not None:
            grammars = GrammarChecker(
                self.config.tokenizer_path, model_vocab_size, self.eos_token_ids
            )
        model = load_model_config(self.config.model_path, self.config.hf_overrides)
        self.adapters = AdapterChecks(model, self.config.enable_lora, self.config.max_lora_rank)
        self.encoder = PromptEncoder(
            tokenizer, vocab_size, self.config.max_model_len or 0, grammars,
            self.config.max_logprobs, model.hidden_size, model.to_dict(),
        )  # fmt: skip

    def queue_depths(self) -> dict[str, int]:
        return {"encoding": len(self.encoding)}

    async def setup(self) -> dict:
        self.clients: bus.Router[ClientRequests] = bus.Router(
            self.ctx, self.addresses.requests, ClientRequests, poll_first_s=bus.POLL_FIRST_S
        )
        self.to_scheduler: bus.Sender[SchedulerInbound] = bus.Sender(
            self.ctx, self.addresses.scheduler_inbox
        )
        self.to_detokenizer: bus.Sender[DetokenizerInbound] = bus.Sender(
            self.ctx, self.addresses.detokenizer_inbox
        )
        self.encoding: dict[tuple[bytes, int], bool] = {}  # off-loop encodes: aborted yet?
        self.threads = anyio.CapacityLimiter(ENCODE_THREADS)
        return {}

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            while True:  # no poll while off-loop encodes wait for the loop to hand them on
                client, message = await self.clients.recv(poll_first=not self.encoding)
                if isinstance(message, GenerateRequest):
                    if self.encoder.inline(message):
                        await self.admit(client, message, off_loop=False)
                    else:
                        self.encoding[(client, message.seq)] = False
                        tg.start_soon(self.admit, client, message, True)
                else:
                    if isinstance(message, AbortRequest):
                        for seq in message.seqs:
                            if (client, seq) in self.encoding:
                                self.encoding[(client, seq)] = True
                    message.client = client
                    await self.to_scheduler.send(message)
                await anyio.lowlevel.checkpoint()  # a polled frame came without the loop's turn

    async def admit(self, client: bytes, request: GenerateRequest, off_loop: bool) -> None:
        """Encode and validate, then hand the request to the scheduler (or refuse it)."""
        arrival = time.time()
        try:
            if request.lora is not None:
                self.adapters.check(request.lora.lora_int_id, request.lora.lora_path)
            self.encoder.check_task(request)
            self.encoder.check_size(request)
            if off_loop:
                ids = await anyio.to_thread.run_sync(
                    self.encoder.encode, request, limiter=self.threads
                )
            else:
                ids = self.encoder.encode(request)
        except Exception as exc:  # a bad input never takes the tokenizer down: a 400
            if not isinstance(exc, ValueError):
                logger.exception("could not encode request %d", request.seq)
            error = RequestError(seq=request.seq, message=str(exc), client=client)
            self.encoding.pop((client, request.seq), None)
            await self.to_detokenizer.send(error)
            return
        if self.encoding.pop((client, request.seq), False):
            return  # aborted while it was being encoded
        await self.to_scheduler.send(
            AddRequest(
                client=client, seq=request.seq, prompt_token_ids=ids, sampling=request.sampling,
                eos_token_ids=self.eos_token_ids, arrival_time=arrival,
                resume_token_ids=request.resume_token_ids, priority=request.priority,
                lora=request.lora, pooling=request.pooling,
            )
        )  # fmt: skip
