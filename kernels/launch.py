"""Launches a Triton kernel through its compiled kernel directly once its specialization is known.

Why: ``kernel[grid](...)`` goes through ``JITFunction.run``, which on every call binds all ~40
arguments, specializes each, builds a string cache key and launch metadata. For an eager decode of
one small request that host work (~35 us for the decode and fold launches on an H100 host, Triton
3.6) exceeds the GPU time (~20 us). ``launch`` makes the first launch of each specialization the
normal way, keeps the compiled kernel it returns, and later calls that kernel's launcher as
``JITFunction.run`` does (``kernel.run(grid, stream, function, packed_metadata, launch metadata,
enter hook, exit hook, *all arguments)``), with no launch hooks: while any are set (a profiler),
every launch takes the normal path.

Its key is at least as fine as Triton's: each argument's type; the value of every argument that is
not a tensor (Triton specializes ints on == 1, % 16 and their range); per tensor its dtype and
``data_ptr() % 16`` (Triton: 16-byte aligned or not); every keyword argument (constexprs and launch
options: num_warps, num_stages, launch_pdl, ...) with its type; the current device; the knobs
``JITFunction.run`` passes to the compiler.

The normal path is used throughout under TRITON_INTERPRET=1, with PAGED_BACKEND_DIRECT_LAUNCH=0,
or on a Triton other than 3.6-3.9 (the versions whose ``JITFunction.run``, ``CompiledKernel`` and
CUDA launcher this was checked against); and per call for what this does not know: an autotuner,
a tensor subclass or other argument type, a tensor passed by keyword, a grid that is not a tuple,
a kernel that reads global variables.
"""
from __future__ import annotations

import os
from itertools import compress, repeat
from operator import and_, attrgetter

import torch
import triton

from kernels.dispatch import INTERPRET

try:
    from triton import knobs
    from triton.knobs import HookChain
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction
except ImportError:  # internals differ from the versions read
    knobs = None

VERSIONS = ((3, 6), (3, 7), (3, 8), (3, 9))
_HANDLED = (torch.Tensor, int, bool, float, type(None))
_MAX_ENTRIES = 4096  # a bound on the cache; when full it starts over (the normal path refills it)
_dtype = attrgetter("dtype")
_data_ptr = torch.Tensor.data_ptr


def pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), for launchers: triton.next_power_of_2 is a
    constexpr_function, whose wrapper costs about a microsecond a call on the host."""
    return 1 << (n - 1).bit_length()


def disabled_by(interpret: bool = INTERPRET, switch: str | None = None, version: str = triton.__version__):
    """Why every launch takes the normal path, or None when launches can go direct."""
    if interpret:
        return "TRITON_INTERPRET=1"
    if (switch if switch is not None else os.environ.get("PAGED_BACKEND_DIRECT_LAUNCH", "1")) == "0":
        return "PAGED_BACKEND_DIRECT_LAUNCH=0"
    if tuple(int(p) for p in version.split(".")[:2] if p.isdigit()) not in VERSIONS or knobs is None:
        return f"Triton {version} (direct launch knows 3.6-3.9)"
    return None


DISABLED_BY = disabled_by()
_layouts: dict = {}  # argument types -> (which are tensors, which are not), or None: a type not handled
# key -> (kernel, compiled kernel, its launcher, function, packed metadata, trailing args), or (): the
# normal path. The key holds id(kernel) (hashing a JITFunction hashes its source key); the entry keeps
# the kernel alive, so no other object can take that id while the entry exists.
_entries: dict = {}
_device = _stream = None  # Triton's own current-device and current-stream calls, taken at first use
_fpsan = knobs is not None and "fpsan_homomorphic_casts" in vars(type(knobs.compilation))  # Triton 3.9


def _layout(types: tuple):
    if not all(t in _HANDLED for t in types):
        return None
    tensors = tuple(t is torch.Tensor for t in types)
    return tensors, tuple(not t for t in tensors)


def arg_key(args: tuple, kw: dict):
    """A hashable key at least as fine as Triton's specialization of ``fn(*args, **kw)``; None for an
    argument type not handled here. Values of ints are kept whole (a new table width is a new key,
    launched the normal way once): finer than Triton's == 1 / % 16 / range, and cheaper to build."""
    types = (*map(type, args),)
    layout = _layouts.get(types, False)
    if layout is False:
        layout = _layouts[types] = _layout(types)
    if layout is None:
        return None
    tensors = (*compress(args, layout[0]),)
    return (types, *compress(args, layout[1]), *kw.items(), *map(type, kw.values()),
            *map(_dtype, tensors), *map(and_, map(_data_ptr, tensors), repeat(15)))


def _watched(fn) -> bool:
    """Pre-run hooks, a profiler's launch hooks or a custom pipeline: only the normal path runs them."""
    rt = knobs.runtime
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    return bool(fn.pre_run_hooks or rt.add_stages_inspection_hook is not None
                or enter is not None and (type(enter) is not HookChain or enter.calls)
                or leave is not None and (type(leave) is not HookChain or leave.calls))


def _bind(fn, compiled, n_args: int, kw: dict) -> tuple:
    """What a direct launch of ``compiled`` (from ``fn[grid](...)``) needs; () where it cannot go direct."""
    names = fn.arg_names[n_args:]
    if fn.used_global_vals or not set(names) <= kw.keys():  # run() re-checks globals; defaults not bound
        return ()
    if any(isinstance(v, torch.Tensor) for v in kw.values()):  # keyed by identity there, not by pointer
        return ()
    function, packed = getattr(compiled, "function", None), getattr(compiled, "packed_metadata", None)
    if function is None or packed is None:
        return ()
    # The compiled kernel itself is kept: Triton 3.9 unloads its module when it is collected.
    return fn, compiled, compiled.run, function, packed, tuple(kw[n] for n in names)


def launch(fn, grid: tuple, *args, **kw) -> None:
    """``fn[grid](*args, **kw)``: ``grid`` a tuple of 1-3 ints, ``kw`` the trailing parameters
    (constexprs) by name and the launch options."""
    global _device, _stream
    entry = ()  # () takes the normal path; None: the normal path, then bind for next time
    if DISABLED_BY is None and type(grid) is tuple and isinstance(fn, JITFunction) and not _watched(fn):
        spec = arg_key(args, kw)
        if spec is not None:
            if _device is None:
                _device, _stream = driver.active.get_current_device, driver.active.get_current_stream
            device, comp = _device(), knobs.compilation
            key = (id(fn), device, knobs.runtime.debug, comp.instrumentation_mode,
                   _fpsan and comp.fpsan_homomorphic_casts, spec)
            try:
                entry = _entries.get(key)
            except TypeError:  # an unhashable keyword value (Triton keys on its str())
                pass
    if entry:
        _, _, run, function, packed, tail = entry
        g = (*grid, 1, 1)
        run(g[0], g[1], g[2], _stream(device), function, packed, None, None, None, *args, *tail)
        return
    compiled = fn[grid](*args, **kw)
    if entry is None:
        if len(_entries) >= _MAX_ENTRIES:
            _entries.clear()
        _entries[key] = _bind(fn, compiled, len(args), kw)
