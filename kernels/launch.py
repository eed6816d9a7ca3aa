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
a kernel that reads global variables other than constexpr constants.

Gluon's host-side TMA descriptors (``TensorDescriptor``) are keyed by every field (the base tensor
by dtype and 16-byte alignment, as tensors). Triton's launcher encodes their TMA maps on every
launch, in a Python wrapper around its C launcher that walks every argument; on Triton 3.6 (the
release the Gluon kernels run on) a direct launch keeps the encoded arguments of each descriptor
per (argument, base address) and calls the C launcher itself (:class:`_TmaLaunch`); elsewhere it
passes the descriptors to the wrapper. :class:`DescriptorRelaunch` relaunches such a launch with
descriptors of new addresses.

A caller that launches the same kernels many times with only some leading arguments changing (a
decode plan's launches, once per layer and step) can skip even that key: ``launch`` returns a
:class:`Bound`, ``Bound.lead(n)`` a :class:`Relaunch` of it with every argument after the first
``n`` fixed, and the caller keeps it under a key of its own that determines those arguments and
the leading tensors' dtypes and 16-byte alignment. ``replay_stream`` says when relaunches may run.
A relaunch passes tensors to the launcher as their device addresses (ints): for a tensor the
launcher calls ``data_ptr()`` and queries the driver about the pointer on every launch (~17 such
queries for an eager decode call), for an int it does neither. So its caller passes device
tensors only, checked to be on the launch's device.
"""
from __future__ import annotations

import os
from itertools import compress, repeat
from operator import and_, attrgetter

import torch
import triton
import triton.language as tl

from paged_backend.kernels.dispatch import INTERPRET

try:
    from triton import knobs
    from triton.knobs import HookChain
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction
except ImportError:  # internals differ from the versions read
    knobs = None

try:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _Descriptor
except ImportError:  # a Triton without Gluon: no descriptor arguments to key
    _Descriptor = None

VERSIONS = ((3, 6), (3, 7), (3, 8), (3, 9))
_HANDLED = (torch.Tensor, int, bool, float, type(None))
_MAX_ENTRIES = 4096  # a bound on the cache; when full it starts over (the normal path refills it)
_MAX_MAPS = 64  # encoded TMA maps kept per compiled Gluon kernel (addresses seen: a few per layer's caches)
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
    """(which arguments are tensors, which are values, which are TMA descriptors or None if none)."""
    descs = tuple(t is _Descriptor for t in types)
    if not all(t in _HANDLED or d for t, d in zip(types, descs)):
        return None
    tensors = tuple(t is torch.Tensor for t in types)
    return tensors, tuple(not (t or d) for t, d in zip(tensors, descs)), descs if any(descs) else None


def _descriptor_key(d) -> tuple:
    """Every field of a TMA descriptor but its base tensor, and that tensor's dtype and alignment."""
    base = d.base
    return (base.dtype, base.data_ptr() & 15,
            *(tuple(v) if isinstance(v, list) else v for k, v in vars(d).items() if k != "base"))


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
    descs = () if layout[2] is None else (*map(_descriptor_key, compress(args, layout[2])),)
    return (types, *compress(args, layout[1]), *descs, *kw.items(), *map(type, kw.values()),
            *map(_dtype, tensors), *map(and_, map(_data_ptr, tensors), repeat(15)))


def _watched(fn) -> bool:
    """Pre-run hooks, a profiler's launch hooks or a custom pipeline: only the normal path runs them."""
    rt = knobs.runtime
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    return bool(fn.pre_run_hooks or rt.add_stages_inspection_hook is not None
                or enter is not None and (type(enter) is not HookChain or enter.calls)
                or leave is not None and (type(leave) is not HookChain or leave.calls))


def _bind(fn, compiled, args: tuple, kw: dict) -> tuple:
    """What a direct launch of ``compiled`` (from ``fn[grid](...)``) needs; () where it cannot go direct."""
    names = fn.arg_names[len(args):]
    # run() re-checks the globals a kernel read; constexpr module constants (the Gluon kernels' ROWS)
    # are taken as constants. Defaults are not bound.
    if any(not isinstance(v, tl.constexpr) for v, _ in fn.used_global_vals.values()) or not set(names) <= kw.keys():
        return ()
    if any(isinstance(v, torch.Tensor) for v in kw.values()):  # keyed by identity there, not by pointer
        return ()
    function, packed = getattr(compiled, "function", None), getattr(compiled, "packed_metadata", None)
    if function is None or packed is None:
        return ()
    descs = [i for i, a in enumerate(args) if type(a) is _Descriptor]
    tma = _TmaLaunch.of(compiled.run, descs) if descs else None
    # The compiled kernel itself is kept: Triton 3.9 unloads its module when it is collected.
    return fn, compiled, compiled.run, function, packed, tuple(kw[n] for n in names), tma


def _context(device) -> tuple:
    """What a direct launch depends on besides its arguments: the device and the knobs that
    ``JITFunction.run`` passes to the compiler."""
    comp = knobs.compilation
    return device, knobs.runtime.debug, comp.instrumentation_mode, _fpsan and comp.fpsan_homomorphic_casts


class Bound:
    """A launch of one compiled specialization (from :func:`launch`): what calling its launcher
    again needs, and the arguments it was launched with."""
    __slots__ = ("entry", "grid", "args", "context")

    def __init__(self, entry: tuple, grid: tuple, args: tuple, context: tuple):
        self.entry, self.grid, self.args, self.context = entry, grid, args, context

    def lead(self, n: int) -> "Relaunch":
        """This launch again with new values for its first ``n`` arguments (see module doc)."""
        return Relaunch(self, n)


class Relaunch:
    """``Bound.lead(n)``: ``relaunch(stream, *first_n_args)`` calls the compiled kernel's launcher
    with the bound launch's other arguments, tensors among them as device addresses (it keeps the
    tensors). The caller passes the first ``n`` arguments with the bound ones' dtypes and 16-byte
    alignment, tensors as ``data_ptr()`` of device tensors, and checks ``replay_stream`` first."""
    __slots__ = ("fn", "context", "run", "g0", "g1", "g2", "function", "packed", "rest", "tensors")

    def __init__(self, bound: Bound, n: int):
        self.fn, _, self.run, self.function, self.packed, tail, _ = bound.entry
        self.g0, self.g1, self.g2 = (*bound.grid, 1, 1)[:3]
        self.context = bound.context
        rest = bound.args[n:]
        self.tensors = [a for a in rest if isinstance(a, torch.Tensor)]  # alive while their addresses are used
        self.rest = (*(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in rest), *tail)

    def __call__(self, stream, *lead) -> None:
        self.run(self.g0, self.g1, self.g2, stream, self.function, self.packed, None, None, None, *lead, *self.rest)


class DescriptorRelaunch:
    """A :class:`Relaunch` of a kernel whose leading arguments include host-side TMA descriptors
    (Gluon's ``TensorDescriptor``, kernels/*_sm90.py): called like a relaunch with a tensor's
    address in each descriptor's place, it passes a descriptor of that address with the bound one's
    shape, strides and padding (on Triton 3.6 the kept TMA map of that address, see
    :class:`_TmaLaunch`). No tensor behind a descriptor is kept. ``again``: positions of the caller's
    arguments that the kernel takes a second time, after them (a tensor bound as a pointer and as a
    descriptor): the caller passes ``n - len(again)``."""
    __slots__ = ("relaunch", "fn", "context", "descs", "tma", "again")

    def __init__(self, bound: Bound, n: int, again: tuple = ()):
        self.again = again
        self.relaunch = bound.lead(n)
        self.fn, self.context = self.relaunch.fn, self.relaunch.context
        # lead position -> (shape, strides, padding) of the descriptor bound there
        self.descs = {i: (a.shape, a.strides, a.padding) for i, a in enumerate(bound.args[:n])
                      if type(a) is _Descriptor}
        tma = bound.entry[6]  # (it expands leading descriptors only: the rest go to the launcher as bound)
        self.tma = tma if tma is not None and all(i < n for i in tma.nth) else None

    def __call__(self, stream, *lead) -> None:
        lead = [*lead]
        for i in self.again:
            lead.append(lead[i])
        for i, (shape, strides, padding) in self.descs.items():
            lead[i] = _HostDescriptor(_Address(lead[i]), shape, strides, padding)
        r = self.relaunch
        if self.tma is None:
            r(stream, *lead)
        else:
            self.tma(r.g0, r.g1, r.g2, stream, r.function, r.packed, self.tma.flat(lead), r.rest)


class _TmaLaunch:
    """Triton 3.6's C launcher behind a compiled Gluon kernel's ``CudaLauncher`` (whose ``launch``
    wraps it in ``inner(*args)``, expanding each descriptor argument with the driver module's
    ``make_tensordesc_arg`` on every call), and the expanded arguments of its descriptors, kept per
    (argument position, base address): the other fields of a descriptor are fixed per compiled
    specialization (they are in the launch's key), and an encoded map is a function of them and the
    address. At most ``_MAX_MAPS`` are kept."""
    __slots__ = ("launcher", "coop", "pdl", "meta", "expand", "nth", "maps")

    def __init__(self, launcher, coop, pdl, meta, expand, positions):
        self.launcher, self.coop, self.pdl, self.meta, self.expand = launcher, coop, pdl, meta, expand
        self.nth = {p: n for n, p in enumerate(positions)}  # argument position -> the descriptor's number
        self.maps = {}

    @classmethod
    def of(cls, run, positions):
        """For the launcher ``run`` of a kernel with descriptors at argument ``positions``, or None
        where ``run`` has another structure or takes scratch buffers."""
        inner = getattr(run, "launch", None)
        code, cells = getattr(inner, "__code__", None), getattr(inner, "__closure__", None)
        if code is None or cells is None or getattr(run, "global_scratch_size", 1) \
                or getattr(run, "profile_scratch_size", 1):
            return None
        env = dict(zip(code.co_freevars, (c.cell_contents for c in cells)))
        expand = inner.__globals__.get("make_tensordesc_arg")
        if set(env) != {"launcher", "tensordesc_indices", "tensordesc_meta"} or expand is None \
                or inner.__globals__.get("_BASE_ARGS_FORMAT_LEN") != 13 \
                or len(env["tensordesc_indices"]) != len(positions):
            return None
        return cls(env["launcher"], run.launch_cooperative_grid, run.launch_pdl, env["tensordesc_meta"], expand,
                   positions)

    def flat(self, args) -> list:
        """``args`` with each descriptor (at a position this launch has them) expanded as the C launcher
        takes it."""
        out = []
        for i, a in enumerate(args):
            if i in self.nth:
                key = (i, a.base.data_ptr())
                got = self.maps.get(key)
                if got is None:
                    if len(self.maps) >= _MAX_MAPS:
                        self.maps.clear()
                    meta = None if self.meta is None else self.meta[self.nth[i]]
                    got = self.maps[key] = (*self.expand(a, meta),)
                out += got
            else:
                out.append(a)
        return out

    def __call__(self, g0, g1, g2, stream, function, packed, args, rest) -> None:
        self.launcher(g0, g1, g2, stream, function, self.coop, self.pdl, None, None, packed, None, None, None,
                      *args, *rest)


class _Address:
    """A device address where Triton's launcher reads a descriptor's base (``base.data_ptr()``)."""
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


class _HostDescriptor:
    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, base, shape, strides, padding):
        self.base, self.shape, self.strides, self.padding = base, shape, strides, padding


def replay_stream(relaunches):
    """The current stream's handle when ``relaunches`` (bound in one context) may run now, else
    None: direct launches are on, nothing watches their kernels (hooks, a profiler), and the
    current device and Triton's knobs are those they were bound under."""
    if DISABLED_BY is not None or any(_watched(r.fn) for r in relaunches):
        return None
    context = _context(_device())
    if context != relaunches[0].context:
        return None
    return _stream(context[0])


def launch(fn, grid: tuple, *args, **kw) -> Bound | None:
    """``fn[grid](*args, **kw)``: ``grid`` a tuple of 1-3 ints, ``kw`` the trailing parameters
    (constexprs) by name and the launch options. -> a :class:`Bound` when this specialization can
    be launched direct (see module doc), else None."""
    global _device, _stream
    entry = ()  # () takes the normal path; None: the normal path, then bind for next time
    if DISABLED_BY is None and type(grid) is tuple and isinstance(fn, JITFunction) and not _watched(fn):
        spec = arg_key(args, kw)
        if spec is not None:
            if _device is None:
                _device, _stream = driver.active.get_current_device, driver.active.get_current_stream
            context = _context(_device())
            key = (id(fn), *context, spec)
            try:
                entry = _entries.get(key)
            except TypeError:  # an unhashable keyword value (Triton keys on its str())
                pass
    if entry:
        _, _, run, function, packed, tail, tma = entry
        g = (*grid, 1, 1)
        if tma is None:
            run(g[0], g[1], g[2], _stream(context[0]), function, packed, None, None, None, *args, *tail)
        else:
            tma(g[0], g[1], g[2], _stream(context[0]), function, packed, tma.flat(args), tail)
        return Bound(entry, grid, args, context)
    compiled = fn[grid](*args, **kw)
    if entry is None:
        if len(_entries) >= _MAX_ENTRIES:
            _entries.clear()
        entry = _entries[key] = _bind(fn, compiled, args, kw)
        if entry:
            return Bound(entry, grid, args, context)
    return None
