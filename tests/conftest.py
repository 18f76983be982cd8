"""Test-session setup. Triton kernels run on the CPU through Triton's interpreter, which must be
switched on before anything imports triton (torch may import it early)."""

import inspect
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# OpenMP's idle threads sleep rather than spin (GNU OpenMP, torch's, spins a while after each
# parallel region by default). Every process here (this one, each engine's actors, each rank of
# a tensor- or pipeline-parallel engine) runs a thread per core, so on a machine of few cores a
# spinning thread takes the CPU another rank or actor is waiting for: the multi-rank tests ran
# ~18% faster on 2 cores. Thread counts, so results, are unchanged; a value set outside wins.
# Set before anything loads OpenMP; the engines' processes inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _patch_interpreted_calls_once_per_launch() -> None:
    """Triton's interpreter (3.x) patches triton.language for the interpreter at each kernel
    launch (and undoes it after), and again, through the same `_patch_lang`, at every call of
    a `@triton.jit` helper inside the kernel (tl.sum, a kernel's own helpers...), never undone:
    an `inspect.getmembers` walk over triton.language, its tensor and its math module per call,
    a third of the run time of the kernel tests. Within one launch, a helper whose language
    modules (triton.language and / or triton.language.core, from its globals) the launch or an
    earlier helper call has patched finds them patched already: the repeated walk finds no
    builtin left to wrap and sets the other attributes to equivalent, stateless stand-ins. So
    it is skipped there; everything else (the launch's own patch and undo, a helper's first
    patch of a module in the launch) is Triton's own code. Not applied when the interpreter is
    off or Triton's internals differ."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original_patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original_patch_lang is None or executor is None or scope_type is None:
        return
    original_launch = executor.__call__
    launches: list[set[int] | None] = []  # per running launch: the language modules patched

    def language_modules(fn) -> set[int]:  # as _patch_lang picks them
        modules = fn.__globals__.values()
        return {id(v) for v in modules if inspect.ismodule(v) and v in (tl, tl.core)}

    def patch_lang(fn):
        if not launches:
            return original_patch_lang(fn)
        modules = language_modules(fn)
        if launches[-1] is not None and modules <= launches[-1]:
            return scope_type()  # nothing to undo (a helper's scope is never undone anyway)
        scope = original_patch_lang(fn)
        launches[-1] = modules | (launches[-1] or set())
        return scope

    def launch(self, *args, **kwargs):
        launches.append(None)
        try:
            return original_launch(self, *args, **kwargs)
        finally:
            launches.pop()

    interpreter._patch_lang = patch_lang
    executor.__call__ = launch


_patch_interpreted_calls_once_per_launch()
