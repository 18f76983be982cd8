"""Tokenizer loading, chat templates and EOS ids for the tokenizer actor."""

from __future__ import annotations

import hashlib
import json
import os
from typing import TYPE_CHECKING, Any

from pagedserve.actors.messages import ChatMessage, PromptOptions

if TYPE_CHECKING:  # transformers (and torch with it) is imported only to load a tokenizer
    from transformers import PreTrainedTokenizerBase

GENERATION_CONFIG = "generation_config.json"
# apply_chat_template's own arguments (and the template's `messages`): not template variables
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "add_special_tokens",
})  # fmt: skip


# the files whose contents decide which class AutoTokenizer builds
TOKENIZER_DECIDING_FILES = (
    "tokenizer_config.json", "config.json", "tokenizer.json", "special_tokens_map.json",
    "tokenizer.model", "vocab.json",
)  # fmt: skip


def load_tokenizer(
    path: str, chat_template: str | None = None, use_fast: bool = True
) -> PreTrainedTokenizerBase:
    """The model's HF tokenizer, from local files only (a directory or the HF cache);
    `chat_template` (Jinja text, `EngineConfig.chat_template`) replaces its own; `use_fast`
    False: the slow (Python) tokenizer where the model has one (tokenizer_mode "slow").

    AutoTokenizer chooses the class (by the tokenizer's config and the model's type) and in
    doing so imports torch: 2-5 s of every actor's start. The class it chose is recorded in
    the user's cache directory (`tokenizer_class_dir`), keyed by the tokenizer's files and the
    transformers version, and later loads (restarts, other actors, later runs) build that class
    directly."""
    record = TokenizerClassRecord(path, use_fast)
    tokenizer = record.load()
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, use_fast=use_fast)
        record.save(type(tokenizer).__name__)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def tokenizer_class_dir() -> str:
    """Where the classes AutoTokenizer chose are recorded: pagedserve/tokenizer-classes in
    $XDG_CACHE_HOME (default ~/.cache), as Hugging Face keeps its caches."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "pagedserve", "tokenizer-classes")


class TokenizerClassRecord:
    """The class AutoTokenizer chose for one tokenizer, in one JSON file named by a digest of
    what decides the choice: the model directory, the mode, the transformers version, and the size
    and modification time of each deciding file. A file that is missing, unreadable or does
    not match is no record: the load takes AutoTokenizer's path."""

    def __init__(self, path: str, use_fast: bool) -> None:
        import transformers

        self.path = path
        self.key = {
            "path": os.path.realpath(path),
            "use_fast": use_fast,
            "transformers": transformers.__version__,
            "files": _file_stamps(path),
        }
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()
        self.file = os.path.join(tokenizer_class_dir(), f"{digest[:32]}.json")
        # a hub id (the HF cache's snapshot may change under the same name) is not recorded
        self.recordable = os.path.isdir(path)

    def load(self) -> PreTrainedTokenizerBase | None:
        """The tokenizer built from the recorded class; None when there is no valid record."""
        if not self.recordable:
            return None
        try:
            with open(self.file, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or record.get("key") != self.key:
            return None
        import transformers

        cls = getattr(transformers, str(record.get("class")), None)
        if not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedTokenizerBase):
            return None
        return cls.from_pretrained(self.path, local_files_only=True)

    def save(self, class_name: str) -> None:
        """Write the record whole or not at all (actors that load a tokenizer start together)."""
        if not self.recordable:
            return
        partial = f"{self.file}.{os.getpid()}"
        try:
            os.makedirs(os.path.dirname(self.file), exist_ok=True)
            with open(partial, "w", encoding="utf-8") as f:
                json.dump({"key": self.key, "class": class_name}, f)
            os.replace(partial, self.file)
        except OSError:
            pass  # a cache: without it the next load takes AutoTokenizer's path again


def _file_stamps(path: str) -> dict[str, list[int]]:
    """[size, mtime in ns] of each deciding file the directory has."""
    stamps = {}
    for name in TOKENIZER_DECIDING_FILES:
        try:
            stat = os.stat(os.path.join(path, name))
        except OSError:
            continue
        stamps[name] = [stat.st_size, stat.st_mtime_ns]
    return stamps


def resolve_chat_template(value: str) -> str:
    """`--chat-template` as vLLM takes it: a file's path, or the Jinja template itself."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if not any(mark in value for mark in ("{{", "{%")):
        raise ValueError(f"chat template {value!r} is neither a file nor a Jinja template")
    return value


def check_prompt_options(options: PromptOptions) -> None:
    """ValueError (a 400) for options that contradict each other, as vLLM answers them."""
    if options.continue_final_message and options.add_generation_prompt:
        raise ValueError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(options.chat_template_kwargs))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase, messages: list[ChatMessage], options: PromptOptions
) -> list[int]:
    """Render `messages` with the tokenizer's chat template as `options` say, and tokenize the
    result (with the tokenizer's special tokens only if options.add_special_tokens)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the model's tokenizer has no chat template; use the completions API with a prompt"
        )
    if not messages:
        raise ValueError("messages must not be empty")
    check_prompt_options(options)
    conversation = [template_message(m) for m in messages]
    try:
        rendered = tokenizer.apply_chat_template(
            conversation,
            tools=options.tools,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            tokenize=False,
            **options.chat_template_kwargs,
        )
    except Exception as exc:  # it ran on the request's values: its failure is the request's
        raise ValueError(f"chat template error: {exc}") from exc
    return list(tokenizer.encode(rendered, add_special_tokens=bool(options.add_special_tokens)))


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it; a call's JSON arguments as an object, as vLLM
    gives them (templates write them with `tojson`)."""
    entry: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        entry["tool_calls"] = [_parsed_arguments(call) for call in message.tool_calls]
    return entry


def _parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def eos_token_ids(model_path: str, tokenizer: PreTrainedTokenizerBase | None) -> list[int]:
    """EOS ids from generation_config.json (int or list), else the tokenizer's EOS; may be []."""
    config = _read_generation_config(model_path)
    eos = config.get("eos_token_id")
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    ids = [eos] if isinstance(eos, int) else list(eos)
    return list(dict.fromkeys(int(i) for i in ids))


def _read_generation_config(model_path: str) -> dict[str, Any]:
    """generation_config.json as a dict; {} when missing (local directory or HF cache)."""
    path = _generation_config_path(model_path)
    if path is None:
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _generation_config_path(model_path: str) -> str | None:
    if os.path.isdir(model_path):
        path = os.path.join(model_path, GENERATION_CONFIG)
        return path if os.path.isfile(path) else None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        path = try_to_load_from_cache(model_path, GENERATION_CONFIG)
    except ValueError:  # not a valid repo id
        return None
    return path if isinstance(path, str) else None
