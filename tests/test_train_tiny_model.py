"""scripts/train_tiny_model.py's training options that the speculative benchmarks rely on
(issue 12): windows that repeat their start (in-context copying) and a run that gives the same
weights for the same seed. Trained here on random token ids for a few steps on the CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import train_tiny_model  # noqa: E402


def test_a_repeated_window_copies_its_first_tokens() -> None:
    generator = torch.Generator().manual_seed(3)
    windows = torch.arange(6 * 65).view(6, 65)
    repeated = train_tiny_model.with_repeat(windows, generator)
    assert repeated.shape == windows.shape
    for row, original in zip(repeated, windows):
        length = int((row == original).logical_not().nonzero()[0])  # the first repeated position
        assert 16 <= length <= 32
        assert torch.equal(row[:length], original[:length])
        assert torch.equal(row[length:], row[: 65 - length])  # period `length`


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`prepare`'s files for a random corpus of 64 token ids, a few of them frequent (so that
    three steps lower the validation loss: the best checkpoint is a trained one)."""
    out = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    p = np.full(64, 0.2 / 60)
    p[1:5] = 0.2
    for name, size in (("train", 20_000), ("val", 4_000)):
        np.save(out / f"{name}.npy", rng.choice(64, size, p=p).astype(np.uint16))
    (out / "data.json").write_text(json.dumps({"vocab_size": 64}))
    return out


def train(data: Path, out: Path, *extra: str) -> dict[str, torch.Tensor]:
    train_tiny_model.main([
        "train", "--data", str(data), "--out", str(out), "--device", "cpu", "--steps", "3",
        "--batch", "4", "--seq-len", "64", "--eval-every", "3", "--val-windows", "2",
        "--warmup", "1", *extra,
    ])  # fmt: skip
    return load_file(out / "model.safetensors")


def test_a_seed_gives_the_same_weights_with_copy_windows(data_dir: Path, tmp_path: Path) -> None:
    flags = ("--deterministic", "--copy-frac", "0.5", "--seed", "7")
    first = train(data_dir, tmp_path / "a", *flags)
    second = train(data_dir, tmp_path / "b", *flags)
    other = train(data_dir, tmp_path / "c", "--deterministic", "--seed", "7")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    # the copy windows change what it trained on
    assert any(not torch.equal(first[name], other[name]) for name in first)
    metrics = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert metrics["copy_frac"] == 0.5 and metrics["deterministic"] is True
