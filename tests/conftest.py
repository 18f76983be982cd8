"""Test-session setup. Triton kernels run on the CPU through Triton's interpreter, which must be
switched on before anything imports triton (torch may import it early)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
