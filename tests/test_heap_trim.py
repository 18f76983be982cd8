"""glibc keeps free chunks between live ones resident; `trim_heap` gives their pages back.

The API server's slow RSS creep (scripts/results/soak_cpu.md) was that: its memory in use stayed
flat while more of its heap's free pages became resident. Here the same shape in a fresh
interpreter (the suite's own heap would already hold free pages for the blocks to reuse): 32 MiB
of 8 KiB blocks (above pymalloc's 512 bytes: glibc's heap), every 16th kept.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedserve.actors.heap_trim import can_trim_heap

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not can_trim_heap(), reason="glibc's malloc_trim"
)

BLOCK = 8192
NUM_BLOCKS = 4096  # 32 MiB
KEEP_EVERY = 16

FRAGMENT_THEN_TRIM = f"""
import json, os
from pathlib import Path
from pagedserve.actors.heap_trim import trim_heap

def heap_resident_bytes():
    # resident bytes of the [heap] mapping (glibc's main arena), from /proc/self/smaps
    resident, in_heap = 0, False
    for line in Path(f"/proc/{{os.getpid()}}/smaps").read_text().splitlines():
        fields = line.split()
        if not fields[0].endswith(":"):
            in_heap = fields[-1] == "[heap]"
        elif in_heap and fields[0] == "Rss:":
            resident += int(fields[1]) << 10
    return resident

before = heap_resident_bytes()
blocks = [b"x" * {BLOCK} for _ in range({NUM_BLOCKS})]  # written: resident
kept = blocks[::{KEEP_EVERY}]
del blocks  # 15/16 freed: free chunks pinned between live ones
resident = heap_resident_bytes()
trim_heap()
trimmed = heap_resident_bytes()
intact = all(block == b"x" * {BLOCK} for block in kept)
print(json.dumps(dict(before=before, resident=resident, trimmed=trimmed, intact=intact)))
"""


def test_trim_returns_the_free_pages_between_live_chunks() -> None:
    run = subprocess.run(
        [sys.executable, "-c", FRAGMENT_THEN_TRIM], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    heap = json.loads(run.stdout)
    freed = (NUM_BLOCKS - NUM_BLOCKS // KEEP_EVERY) * BLOCK
    # free() gave nothing back: the freed 30 MiB are still resident
    assert heap["resident"] - heap["before"] > freed // 2, heap
    assert heap["resident"] - heap["trimmed"] > freed // 2, heap
    assert heap["intact"]  # the live chunks are untouched
