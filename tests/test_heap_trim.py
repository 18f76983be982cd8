"""glibc keeps free chunks between live ones resident; `trim_heap` gives their pages back.

The API server's slow RSS creep (scripts/results/soak_cpu.md) was that: its memory in use stayed
flat while more of its heap's free pages became resident. Here the same shape in this process:
32 MiB of 8 KiB blocks (above pymalloc's 512 bytes: glibc's heap), every 16th kept.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from pagedserve.actors.heap_trim import can_trim_heap, trim_heap

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not can_trim_heap(), reason="glibc's malloc_trim"
)

BLOCK = 8192
NUM_BLOCKS = 4096  # 32 MiB
KEEP_EVERY = 16


def heap_resident_bytes() -> int:
    """Resident bytes of the [heap] mapping (glibc's main arena), from /proc/self/smaps."""
    resident, in_heap = 0, False
    for line in Path(f"/proc/{os.getpid()}/smaps").read_text().splitlines():
        fields = line.split()
        if not fields[0].endswith(":"):
            in_heap = fields[-1] == "[heap]"
        elif in_heap and fields[0] == "Rss:":
            resident += int(fields[1]) << 10
    return resident


def fragment_heap() -> list[bytes]:
    """Fill 32 MiB of the heap and free 15/16 of it: free chunks pinned between live ones."""
    blocks = [b"x" * BLOCK for _ in range(NUM_BLOCKS)]  # written: resident
    return blocks[::KEEP_EVERY]


def test_trim_returns_the_free_pages_between_live_chunks() -> None:
    before = heap_resident_bytes()
    kept = fragment_heap()
    freed = (NUM_BLOCKS - len(kept)) * BLOCK
    resident = heap_resident_bytes()
    # free() gave nothing back: the freed 30 MiB are still resident
    assert resident - before > freed // 2
    trim_heap()
    trimmed = heap_resident_bytes()
    assert resident - trimmed > freed // 2, (before, resident, trimmed)
    assert all(block == b"x" * BLOCK for block in kept)  # the live chunks are untouched
