"""Loading the HF tokenizer: the class AutoTokenizer chose (AutoTokenizer imports torch) is
recorded in the user's cache directory, and a later load in any process builds that class
directly and gets the same tokenizer; a record that does not match the tokenizer's files is
not used."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.actors.chat import TokenizerClassRecord, load_tokenizer, tokenizer_class_dir
from pagedserve.config import DEFAULT_MODEL, resolve_model_path

EMBEDDED = Path(resolve_model_path(DEFAULT_MODEL))
LOAD = """
import json, sys
from pagedserve.actors.chat import load_tokenizer
tokenizer = load_tokenizer(sys.argv[1])
ids = tokenizer.encode("Hello world, <|user|> thou art\\n  here.")
chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True)
print(json.dumps({"class": type(tokenizer).__name__, "torch": "torch" in sys.modules,
                  "ids": ids, "text": tokenizer.decode(ids), "chat": chat, "size": len(tokenizer)}))
"""


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home


def load_in_fresh_process(model: Path) -> dict:
    command = [sys.executable, "-c", LOAD, str(model)]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=120, check=True, env=os.environ.copy()
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def qwen2_typed_copy(tmp_path: Path) -> Path:
    """The embedded tokenizer declared as `PreTrainedTokenizerFast` in a qwen2 model: there
    AutoTokenizer chooses `Qwen2Tokenizer`, not the declared class."""
    model = tmp_path / "qwen2"
    shutil.copytree(EMBEDDED, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    return model


def records(cache_home: Path) -> list[Path]:
    return sorted((cache_home / "pagedserve" / "tokenizer-classes").glob("*.json"))


@pytest.mark.parametrize("kind", ["embedded", "qwen2-typed"])
def test_a_later_load_builds_the_recorded_class_without_torch(
    kind: str, tmp_path: Path, cache_home: Path
) -> None:
    model = EMBEDDED if kind == "embedded" else qwen2_typed_copy(tmp_path)
    first = load_in_fresh_process(model)
    assert len(records(cache_home)) == 1
    second = load_in_fresh_process(model)
    assert first["torch"] and not second["torch"]
    assert second == {**first, "torch": False}
    if kind == "qwen2-typed":
        assert second["class"] == "Qwen2Tokenizer"


def test_the_record_lives_in_the_user_cache_directory(cache_home: Path) -> None:
    assert tokenizer_class_dir() == str(cache_home / "pagedserve" / "tokenizer-classes")
    assert TokenizerClassRecord(str(EMBEDDED), True).file.startswith(tokenizer_class_dir())


def test_a_changed_tokenizer_file_is_a_new_record(tmp_path: Path, cache_home: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(EMBEDDED, model)
    assert type(load_tokenizer(str(model))).__name__ == "TokenizersBackend"
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    assert type(load_tokenizer(str(model))).__name__ == "Qwen2Tokenizer"
    assert len(records(cache_home)) == 2
    assert (
        TokenizerClassRecord(str(model), True).file != TokenizerClassRecord(str(model), False).file
    )


def test_a_forged_or_broken_record_is_not_used(tmp_path: Path, cache_home: Path) -> None:
    model = qwen2_typed_copy(tmp_path)
    load_tokenizer(str(model))
    record = TokenizerClassRecord(str(model), True)
    saved = json.loads(Path(record.file).read_text())
    assert saved == {"key": record.key, "class": "Qwen2Tokenizer"}
    for forged in [
        {**saved, "class": "dict"},  # not a tokenizer class
        {**saved, "class": "TokenizersBackend", "key": {**record.key, "path": "/elsewhere"}},
        "{not json",
    ]:
        Path(record.file).write_text(forged if isinstance(forged, str) else json.dumps(forged))
        assert type(load_tokenizer(str(model))).__name__ == "Qwen2Tokenizer"


def test_an_unwritable_cache_directory_only_costs_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # a file: no directory can be made
    assert type(load_tokenizer(str(EMBEDDED))).__name__ == "TokenizersBackend"
