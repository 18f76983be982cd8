"""Checks made in the parent process before any actor starts (`LLM(...)`, `pagedserve serve`),
so that a setting that cannot work fails at once with one clear message instead of an engine
that starts and then rejects every request."""

from __future__ import annotations

import glob
import os
import socket
import ssl

import msgspec

from pagedserve.actors.chat import resolve_chat_template
from pagedserve.api.sampling_defaults import sampling_defaults
from pagedserve.config import EngineConfig, read_hf_config
from pagedserve.models.lora_format import check_adapter
from pagedserve.models.model_config import classifier_token_ids, load_model_config

# A directory holding any of these has a tokenizer transformers can load
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tekken.json")
TOKENIZER_PATTERNS = ("*.tiktoken", "*spiece.model", "*sentencepiece*.model")


def prepare_config(config: EngineConfig) -> EngineConfig:
    """`config` checked, with its chat template read from a file when given one; ValueError
    with the fix when it cannot work."""
    check_tokenizer_files(config)
    check_score_head_tokens(config)
    check_lora_modules(config)
    check_tls_files(config)
    sampling_defaults(config)  # an unusable --generation-config fails now
    if config.chat_template is not None:
        template = resolve_chat_template(config.chat_template)
        config = msgspec.structs.replace(config, chat_template=template)
    return config


def check_tokenizer_files(config: EngineConfig) -> None:
    if config.skip_tokenizer_init:
        return
    path = config.tokenizer_path
    found = any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES) or any(
        glob.glob(os.path.join(glob.escape(path), pattern)) for pattern in TOKENIZER_PATTERNS
    )
    if not found:
        raise ValueError(
            f"{path} has no tokenizer (no {', '.join(TOKENIZER_FILES)}): give one with "
            "tokenizer=DIR (--tokenizer DIR), or run with skip_tokenizer_init=True "
            "(--skip-tokenizer-init) to send and receive token ids only"
        )


def check_score_head_tokens(config: EngineConfig) -> None:
    """A score head made from the LM head (hf_overrides' classifier_from_token) needs its
    tokens in the tokenizer's vocabulary: the workers look them up when they load."""
    hf_config = read_hf_config(config.model_path, config.hf_overrides)
    if hf_config.get("method") is not None:
        classifier_token_ids(config.tokenizer_path, hf_config["classifier_from_token"])


def check_lora_modules(config: EngineConfig) -> None:
    """The served LoRA adapters (--lora-modules, --allow-runtime-lora-updating) need
    --enable-lora and must fit the model."""
    if config.server is None:
        return
    if config.server.allow_runtime_lora_updating and not config.enable_lora:
        raise ValueError("--allow-runtime-lora-updating needs --enable-lora")
    modules = config.server.lora_modules
    if not modules:
        return
    if not config.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    model = load_model_config(config.model_path, config.hf_overrides)
    for name, path in modules.items():
        try:
            check_adapter(path, model, config.max_lora_rank)
        except ValueError as exc:
            raise ValueError(f"LoRA module {name!r}: {exc}") from None


def check_tls_files(config: EngineConfig) -> None:
    """--ssl-certfile and --ssl-keyfile (and --ssl-ca-certs) must load as uvicorn loads them."""
    server = config.server
    if server is None or server.ssl_certfile is None:
        return
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(server.ssl_certfile, server.ssl_keyfile)
        if server.ssl_ca_certs is not None:
            context.load_verify_locations(server.ssl_ca_certs)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"TLS: cannot load the certificate, key or CA files: {exc}") from None


def check_port_free(host: str, port: int) -> None:
    try:
        socket.create_server((host, port)).close()
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise ValueError(f"cannot listen on {host}:{port}: {reason}") from None
