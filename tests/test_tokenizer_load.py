"""Loading the HF tokenizer: a restarted actor builds the class the run's first load chose,
without AutoTokenizer (which imports torch), and gets the same tokenizer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.actors.chat import TOKENIZER_CLASS_FILE, load_tokenizer
from pagedserve.config import DEFAULT_MODEL, resolve_model_path

EMBEDDED = Path(resolve_model_path(DEFAULT_MODEL))
LOAD = """
import json, sys
from pagedserve.actors.chat import load_tokenizer
tokenizer = load_tokenizer(sys.argv[1], None, sys.argv[2])
ids = tokenizer.encode("Hello world, <|user|> thou art\\n  here.")
chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True)
print(json.dumps({"class": type(tokenizer).__name__, "torch": "torch" in sys.modules,
                  "ids": ids, "text": tokenizer.decode(ids), "chat": chat, "size": len(tokenizer)}))
"""


def load_in_fresh_process(model: Path, run_dir: Path) -> dict:
    command = [sys.executable, "-c", LOAD, str(model), str(run_dir)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def qwen2_typed_copy(tmp_path: Path) -> Path:
    """The embedded tokenizer declared as `PreTrainedTokenizerFast` in a qwen2 model: there
    AutoTokenizer chooses `Qwen2Tokenizer`, not the declared class."""
    model = tmp_path / "qwen2"
    shutil.copytree(EMBEDDED, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    return model


@pytest.mark.parametrize("kind", ["embedded", "qwen2-typed"])
def test_a_second_load_in_the_run_builds_the_recorded_class_without_torch(
    kind: str, tmp_path: Path
) -> None:
    model = EMBEDDED if kind == "embedded" else qwen2_typed_copy(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = load_in_fresh_process(model, run_dir)
    assert (run_dir / TOKENIZER_CLASS_FILE).is_file()
    second = load_in_fresh_process(model, run_dir)
    assert first["torch"] and not second["torch"]
    assert second == {**first, "torch": False}
    if kind == "qwen2-typed":
        assert second["class"] == "Qwen2Tokenizer"


def test_a_record_for_another_tokenizer_is_not_used(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    load_tokenizer(str(EMBEDDED), None, str(run_dir))
    record = json.loads((run_dir / TOKENIZER_CLASS_FILE).read_text())
    assert record["class"] == "TokenizersBackend"
    model = qwen2_typed_copy(tmp_path)
    assert type(load_tokenizer(str(model), None, str(run_dir))).__name__ == "Qwen2Tokenizer"
    forged = {**record, "path": str(model), "class": "dict"}
    (run_dir / TOKENIZER_CLASS_FILE).write_text(json.dumps(forged))
    assert type(load_tokenizer(str(model), None, str(run_dir))).__name__ == "Qwen2Tokenizer"
    (run_dir / TOKENIZER_CLASS_FILE).write_text("{not json")
    assert type(load_tokenizer(str(model), None, str(run_dir))).__name__ == "Qwen2Tokenizer"
