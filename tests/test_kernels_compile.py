"""Kernels compiled for an H100/H200 (sm_90a) on the CPU, as the GPU would compile them: the
launchers run on CPU tensors with each kernel launch compiled instead of run, through Triton's
compiler and ptxas (both ship with Triton).

- The sampler's Triton kernels: CI runs them under ``TRITON_INTERPRET=1``, which executes them as
  numpy and never type-checks them as the compiler does - a variable whose type changed in a branch
  ran under the interpreter and failed to compile on the H200 (2026-11-29, ``kernels/top_p.py``).
- The Hopper (Gluon) kernels, which nothing runs without an sm_90 GPU: compiled through their own
  launchers with Triton posing as a CUDA driver of an sm_90 device (``_Sm90Driver``), so a change to
  them is type-checked, lowered and register-allocated before a device call. Gluon's API moves
  between releases: these run with a Triton the kernels were checked on (``dispatch.SM90_TRITON``;
  ``bash tests/compile_sm90.sh`` puts one on the path, as CI does) and skip otherwise - or fail,
  with ``PAGED_BACKEND_REQUIRE_SM90_COMPILE=1`` (CI).

Register spills fail: a spill in a kernel's inner loop costs every call. So do divergent branches in a
Hopper kernel (``BRA.DIV`` in its SASS): a sign that ptxas could not prove a value warp-uniform (a request
index from a reduction), which moves everything derived from it off the uniform datapath - the persistent
prefill ran 20-25% slower for it (benchmarks/results/sweeps/prefill_persistent_h200.log)."""
import os
import re
import subprocess
import tempfile

import numpy as np

import pytest
import torch

triton = pytest.importorskip("triton")
try:
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction
except ImportError as e:  # (a Triton without its NVIDIA backend)
    pytest.skip(f"Triton's NVIDIA backend is not importable: {e}", allow_module_level=True)

from paged_backend.kernels.dispatch import INTERPRET, SM90_TRITON, triton_release

pytestmark = pytest.mark.skipif(INTERPRET, reason="the interpreter replaces the kernels this compiles")
TYPES = {torch.float32: "fp32", torch.float64: "fp64", torch.float16: "fp16", torch.bfloat16: "bf16",
         torch.int64: "i64", torch.int32: "i32", torch.uint8: "u8", torch.bool: "i1"}
TARGET = GPUTarget("cuda", 90, 32)


def launches(monkeypatch, launch) -> list:
    """Runs ``launch()`` with every Triton kernel launch recorded, not run -> [(kernel, its arguments
    by name, num_warps)], one per distinct kernel and constexpr values."""
    calls = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *args, grid, warmup, **kw: calls.append((self, args, kw)))
    launch()
    out, seen = [], set()
    for fn, args, kw in calls:
        vals = {**dict(zip(fn.arg_names, args)), **{k: v for k, v in kw.items() if k in fn.arg_names}}
        key = (fn.__name__, tuple((p.name, vals[p.name]) for p in fn.params if p.is_constexpr))
        if key not in seen:
            seen.add(key)
            out.append((fn, vals, kw.get("num_warps", 4)))
    return out


def compile_sm90(fn, vals: dict, num_warps: int) -> str:
    """Compiles one launch for sm_90a -> ptxas's resource line (registers, spills)."""
    sig, constexprs = {}, {}
    for p in fn.params:
        v = vals[p.name]
        if p.is_constexpr:
            sig[p.name], constexprs[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + TYPES[v.dtype]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
        else:
            sig[p.name] = "fp32"
    kernel = triton.compile(ASTSource(fn, sig, constexprs), target=TARGET, options={"num_warps": num_warps})
    return ptxas_info(kernel.asm["ptx"])


def ptxas_info(ptx: str) -> str:
    """ptxas's resource lines (registers, spills) of a kernel's PTX for sm_90a, and its warning when it
    serialises a kernel's wgmma (each waited for as issued)."""
    info = subprocess.run([get_ptxas(TARGET.arch).path, "-v", "--gpu-name", "sm_90a", "-", "-o", "/dev/null"],
                          input=ptx, capture_output=True, text=True, check=True).stderr
    return " ".join(line.split("info    :")[-1].strip() for line in info.splitlines()
                    if "spill" in line or "registers" in line or "serialized" in line)


def sass(cubin: bytes) -> str:
    """A kernel's SASS (cuobjdump ships next to ptxas)."""
    cuobjdump = os.path.join(os.path.dirname(get_ptxas(TARGET.arch).path), "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([cuobjdump, "--dump-sass", f.name], capture_output=True, text=True, check=True).stdout


def _top_p(s, v):
    from paged_backend.kernels.top_p import top_p_floor_triton
    return lambda: top_p_floor_triton(torch.randn(s, v), torch.full((s,), float("-inf")), torch.full((s,), 0.9))


def _gumbel(s, v, stats):
    from paged_backend.gumbel import vocab_hash
    from paged_backend.kernels import gumbel as G
    keys = torch.arange(s, dtype=torch.int64)
    if stats:
        return lambda: G.gumbel_sample_triton(torch.randn(s, v).bfloat16(), torch.ones(s), keys, vocab_hash(v, "cpu"))
    return lambda: G.gumbel_argmax_triton(torch.randn(s, v), keys, vocab_hash(v, "cpu"))


@pytest.mark.parametrize("case", ["top_p 64x128256", "top_p 4096x32", "gumbel 64x128256", "gumbel_sample 64x49152"])
def test_sampler_kernels_compile_for_sm90_without_spills(monkeypatch, case):
    name, shape = case.split()
    s, v = map(int, shape.split("x"))
    launch = {"top_p": lambda: _top_p(s, v), "gumbel": lambda: _gumbel(s, v, False),
              "gumbel_sample": lambda: _gumbel(s, v, True)}[name]()
    found = launches(monkeypatch, launch)
    assert found, "no kernel launch recorded"
    for fn, vals, num_warps in found:
        info = compile_sm90(fn, vals, num_warps)
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill", info)]
        assert spills and not any(spills), (fn.__name__, info)


class _Sm90Driver:
    """What Triton asks of its active driver to compile a launch: an sm_90 CUDA target (no device is
    touched: launches are compiled only, see ``sm90_compiled``)."""

    def get_current_target(self):
        return TARGET

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


SM90_SHARED_BYTES = 227 * 1024  # the most shared memory a program may opt into on sm_90


def require_sm90_triton():
    """Skips (fails under ``PAGED_BACKEND_REQUIRE_SM90_COMPILE=1``) unless this is the Triton the Gluon kernels
    are checked on."""
    if triton_release() not in SM90_TRITON:
        why = (f"the Gluon kernels are checked on Triton {', '.join(SM90_TRITON)}, this is {triton.__version__} "
               "(bash tests/compile_sm90.sh runs these with one)")
        if os.environ.get("PAGED_BACKEND_REQUIRE_SM90_COMPILE") == "1":
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture
def sm90_compiled(monkeypatch):
    """Every Triton/Gluon launch in the test compiled for sm_90a, not run -> the list of (kernel name,
    ptxas's resource line, shared memory bytes, divergent branches) it fills."""
    require_sm90_triton()
    from triton.runtime import driver
    from paged_backend.cascade import fused, partition
    out, run = [], JITFunction.run

    def compile_only(self, *args, grid, warmup, **kw):
        kernel = run(self, *args, grid=grid, warmup=True, **kw)
        code = sass(kernel.asm["cubin"])
        out.append((self.__name__, ptxas_info(kernel.asm["ptx"]), kernel.metadata.shared, code.count("BRA.DIV")))

    monkeypatch.setattr(JITFunction, "run", compile_only)
    monkeypatch.setattr(fused, "use_sm90", lambda device: True)  # plans cut for the Hopper kernel
    monkeypatch.setattr(partition, "num_sms", lambda device: 132)  # an H100/H200's
    monkeypatch.setattr(driver, "_active", _Sm90Driver())
    return out


def _node_call(hq, hkv, d, softcap, tails=True, kv_dtype=torch.bfloat16):
    """The Hopper cascade node kernel with the tails in its launch (the engine's decode step of 64
    samples of a 4K prompt, 40 tokens each), or (``tails`` False) its node pieces only (over an fp8
    ``kv_dtype``, bf16 queries)."""
    import paged_backend as pb
    from paged_backend.kernels.cascade_sm90 import cascade_nodes_sm90, node_sm90_config
    n, bs, prefix = 64, 16, 4096
    pages = prefix // bs
    table = np.concatenate([np.tile(np.arange(pages, dtype=np.int32), (n, 1)),
                            pages + np.arange(n * 4, dtype=np.int32).reshape(n, 4)], axis=1)  # [n, pages + 4]
    plan = pb.plan_cascade(table, np.full(n, prefix + 40), num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                           block_size=bs, device=torch.device("cpu"), block_table_device=torch.from_numpy(table))
    q = torch.zeros(n, hq, d, dtype=torch.bfloat16)
    k = torch.zeros(pages + n * 4, bs, hkv, d, dtype=kv_dtype)
    scales = (torch.ones(1), torch.ones(1)) if kv_dtype.itemsize == 1 else (None, None)
    cfg = node_sm90_config(q, k, k.clone(), plan, softcap, scales)
    assert cfg is not None and "fused_prog_ptr" in plan.views, "the plan is not one the Hopper kernel runs"
    return lambda: cascade_nodes_sm90(q, k, k.clone(), plan, d ** -0.5, cfg, True, tails)


def _prefill_call(hq, hkv, d, causal, sinks, q_tma=True, kv_dtype=torch.bfloat16, softcap=0.0):
    """The Hopper paged prefill: two requests of 300 and 77 new tokens over 1000 and 77 keys (``q_tma``
    False: queries 2 bytes past 16-byte alignment, which the consumers load themselves), bf16 queries over a
    ``kv_dtype`` cache."""
    from paged_backend.kernels.prefill_sm90 import prefill_sm90, sm90_config
    bs, lens, new = 16, [1000, 77], [300, 77]
    t = sum(new)
    q = torch.zeros(t * hq * d + 1, dtype=torch.bfloat16)[int(not q_tma):][:t * hq * d].view(t, hq, d)
    k = torch.zeros(80, bs, hkv, d, dtype=kv_dtype)
    table = torch.arange(2 * 64, dtype=torch.int32).reshape(2, 64) % 80
    qsl = torch.tensor([0, new[0], t], dtype=torch.int32)
    out, lse = torch.empty(t, hq, d, dtype=torch.bfloat16), torch.empty(t, hq)
    scales = (torch.ones(1), torch.ones(1)) if kv_dtype.itemsize == 1 else (None, None)
    cfg = sm90_config(q, k, k.clone(), softcap, 0, scales)
    assert cfg is not None, "not a call the Hopper prefill takes"
    s = torch.zeros(hq) if sinks else None
    return lambda: prefill_sm90(q, k, k.clone(), table, torch.tensor(lens, dtype=torch.int32), qsl, d ** -0.5,
                                causal, out, lse, cfg, sinks=s)


def _decode_call(hq, hkv, d, kv_dtype, per_sm=2, softcap=0.0, sinks=False, q_dtype=torch.bfloat16, beside=False):
    """The Hopper decode: a 4K request cut over programs and a short one, ``q_dtype`` queries over fp8 caches
    (else the cache's); a plan of ``per_sm`` programs an SM (the CPU's 4 "SMs": its register budget); ``beside``:
    its pieces launched beside the kernel before them, as a cascade's tails (``pieces_sm90``, WAIT_AT_END)."""
    import paged_backend as pb
    from paged_backend.kernels.decode_sm90 import covered, decode_sm90, pieces_sm90
    bs, lens = 16, [4096, 77]
    pages = sum(-(-n // bs) for n in lens)
    plan = pb.plan_decode(np.array(lens), num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                          device=torch.device("cpu"), num_programs=4 * per_sm)
    q = torch.zeros(2, hq, d, dtype=q_dtype if kv_dtype.itemsize == 1 else kv_dtype)
    k = torch.zeros(pages, bs, hkv, d, dtype=kv_dtype)
    table = torch.arange(2 * pages, dtype=torch.int32).reshape(2, pages) % pages
    out, lse = torch.empty(2, hq, d, dtype=q.dtype), torch.empty(2, hq)
    scales = (torch.ones(1), torch.ones(1)) if kv_dtype.itemsize == 1 else (None, None)
    view = covered(q, k, k.clone(), plan)
    assert view is not None, "not a call the Hopper decode takes"
    s = torch.zeros(hq) if sinks else None
    sl = torch.tensor(lens, dtype=torch.int32)
    if beside:
        return lambda: pieces_sm90(q, k, k.clone(), table, sl, out, lse, plan.partial_o, plan.partial_lse, plan.work,
                                   plan.prog_ptr, plan.num_programs, per_sm, d ** -0.5, scales, view, True, softcap,
                                   s, beside_prior=True)
    return lambda: decode_sm90(q, k, k.clone(), table, sl, out, lse, plan, d ** -0.5, scales, view, True, softcap, s)


SM90_CASES = {
    "decode d128 g4 e4m3": lambda: _decode_call(32, 8, 128, torch.float8_e4m3fn),
    "decode d64 g16 e5m2": lambda: _decode_call(16, 1, 64, torch.float8_e5m2),
    "decode d64 g16 e5m2 fp16 queries": lambda: _decode_call(16, 1, 64, torch.float8_e5m2, q_dtype=torch.float16),
    "decode d128 g4 e4m3 3/SM": lambda: _decode_call(32, 8, 128, torch.float8_e4m3fn, 3),
    "decode d128 g4 e4m3 3/SM beside (cascade tails)": lambda: _decode_call(32, 8, 128, torch.float8_e4m3fn, 3,
                                                                           beside=True),
    "decode d128 g16 e4m3 3/SM": lambda: _decode_call(32, 2, 128, torch.float8_e4m3fn, 3),
    "decode d64 g8 e5m2 3/SM": lambda: _decode_call(32, 4, 64, torch.float8_e5m2, 3),
    "decode d128 g16 e4m3 3/SM softcap sinks": lambda: _decode_call(32, 2, 128, torch.float8_e4m3fn, 3, 30.0, True),
    "decode d128 g4 bf16 softcap sinks": lambda: _decode_call(32, 8, 128, torch.bfloat16, 2, 30.0, True),
    "decode d128 g4 bf16": lambda: _decode_call(32, 8, 128, torch.bfloat16),
    "decode d64 g1 fp16": lambda: _decode_call(8, 8, 64, torch.float16),
    "cascade_node d128 g4": lambda: _node_call(32, 8, 128, 0.0),
    "cascade_node d64 g8 softcap": lambda: _node_call(32, 4, 64, 30.0),
    "cascade_node d128 g4 nodes only": lambda: _node_call(32, 8, 128, 0.0, False),
    "cascade_node d128 g8": lambda: _node_call(32, 4, 128, 0.0),
    "cascade_node d128 g4 e4m3 nodes only": lambda: _node_call(32, 8, 128, 0.0, False, torch.float8_e4m3fn),
    "cascade_node d64 g8 e5m2 softcap nodes only": lambda: _node_call(32, 4, 64, 30.0, False, torch.float8_e5m2),
    "cascade_node d128 g4 e4m3": lambda: _node_call(32, 8, 128, 0.0, True, torch.float8_e4m3fn),
    "cascade_node d128 g8 e4m3": lambda: _node_call(32, 4, 128, 0.0, True, torch.float8_e4m3fn),
    "cascade_node d64 g8 e5m2 softcap": lambda: _node_call(32, 4, 64, 30.0, True, torch.float8_e5m2),
    "prefill d128 g4 causal": lambda: _prefill_call(32, 8, 128, True, False),
    "prefill d64 g1 sinks": lambda: _prefill_call(8, 8, 64, False, True),
    "prefill d128 g4 causal, queries without TMA": lambda: _prefill_call(32, 8, 128, True, False, False),
    "prefill d128 g4 causal e4m3": lambda: _prefill_call(32, 8, 128, True, False, kv_dtype=torch.float8_e4m3fn),
    "prefill d64 g8 e5m2 softcap sinks": lambda: _prefill_call(32, 4, 64, False, True, kv_dtype=torch.float8_e5m2,
                                                              softcap=30.0),
    "prefill d128 g1 causal e4m3, queries without TMA": lambda: _prefill_call(8, 8, 128, True, False, False,
                                                                             torch.float8_e4m3fn),
}


@pytest.mark.parametrize("case", list(SM90_CASES))
def test_gluon_kernels_compile_for_sm90_without_spills(sm90_compiled, case):
    """Each Hopper kernel compiles for sm_90a, spills nothing, fits a program's
    shared memory on the H100/H200 (227 KiB: a launch over it fails only on the GPU), has no divergent branch
    and keeps its wgmma asynchronous (ptxas serialises every wgmma of a kernel when, e.g., an in-flight
    accumulator and another value meet where two paths join - with nothing but a note in its output). (The causal
    128-key prefill spilled 128 + 136 bytes until its P became the 16-bit operand right after each
    softmax: attend_tiles' EARLY_P.)"""
    SM90_CASES[case]()()
    assert sm90_compiled, "no kernel launch compiled"
    for name, info, shared, divergent in sm90_compiled:
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill", info)]
        assert spills == [0, 0], (name, info)
        assert shared <= SM90_SHARED_BYTES, (name, shared)
        assert divergent == 0, (name, f"{divergent} BRA.DIV: a value ptxas cannot prove warp-uniform")
        assert "serialized" not in info, (name, info)


def _coords(bases, index):
    """A linear layout's coordinate of ``index`` over ``bases`` (XOR of the bases of its set bits)."""
    row = col = 0
    for bit, (r, c) in enumerate(bases):
        if index >> bit & 1:
            row, col = row ^ r, col ^ c
    return row, col


def _swizzled(row, byte, row_bytes, swizzle):
    """The address of ``byte`` in ``row`` of an NVMMA tile of ``row_bytes``-byte rows with ``swizzle``-byte
    swizzle: the 16-byte column XORed with the address's bits from 7 up (CUTLASS's Swizzle<log2(swizzle/16), 4, 3>)."""
    a = row * row_bytes + byte
    return a ^ ((a >> 7) & (swizzle // 16 - 1)) << 4


def _bank_group(row, byte, row_bytes=128):
    """The 16-byte bank group (of 8) of ``byte`` in ``row`` of an NVMMA tile with 128-byte swizzle: rows wider than
    128 bytes are spans of 128 bytes (whole multiples of 128 bytes apart), and a span's 16-byte column moves by the
    row."""
    return _swizzled(row, byte % row_bytes, row_bytes, 128) // 16 % 8


@pytest.mark.parametrize("rows, warps", [(64, 4), (64, 2), (8, 2)])
def test_fp8_tile_copy_down_the_rows_has_no_bank_conflicts(rows, warps):
    """``ring_sm90._tile_rows(..., down=True)`` over fp8 rows of 128 values: a bijection of the tile whose 16-byte
    accesses, eight threads a phase, read eight bank groups of the fp8 tile and write eight of the fp16 one (two
    16-byte stores a thread); threads along a row (the other layout) wrote 2 to each of 4 (ncu, H200)."""
    require_sm90_triton()
    from paged_backend.kernels.ring_sm90 import _tile_rows
    lay = _tile_rows(rows, 128, 1, warps, True)
    bases = lay.reg_bases + lay.lane_bases + lay.warp_bases
    assert sorted(_coords(bases, i) for i in range(rows * 128)) == [(r, c) for r in range(rows) for c in range(128)]
    regs, lanes = len(lay.reg_bases), len(lay.lane_bases)
    for warp in range(warps):
        for phase in range(4):
            firsts = [_coords(bases, ((warp << lanes | phase * 8 + t) << regs)) for t in range(8)]
            assert sorted(_bank_group(r, c) for r, c in firsts) == list(range(8))  # fp8 loads
            for half in (0, 8):  # fp16 stores: each thread's 16 values as two 16-byte stores
                assert sorted(_bank_group(r, 2 * (c + half)) for r, c in firsts) == list(range(8))


@pytest.mark.parametrize("d", [64, 128])
def test_fp8_v_operand_loads_without_bank_conflicts_into_v_rows(d):
    """The fp8 decode's V^T (``attend_sm90._v8_operand``) over a 64-key tile: ``_v8_layout`` covers the tile once,
    each load of a warp (a thread's contiguous bytes of one key) finds every bank at most one word, and row ``r``
    of the relabelled operand is head dim ``v_rows(r)``, where the consumer stores the output's row ``r``."""
    require_sm90_triton()
    from triton.experimental.gluon import language as gl
    from paged_backend.kernels.attend_sm90 import _v8_layout, _v_relabel, v_rows
    n = 64
    lay = _v8_layout(n, d)
    bases = lay.reg_bases + lay.lane_bases + lay.warp_bases
    assert sorted(_coords(bases, i) for i in range(n * d)) == [(k, c) for k in range(n) for c in range(d)]
    swizzle = gl.NVMMASharedLayout.get_default_for([n, d], gl.float8e4nv).swizzle_byte_width
    width = d // 64  # the first reg bases run along the head dim: one load of 2 ** width bytes
    regs, lanes = len(lay.reg_bases), len(lay.lane_bases)
    for warp in range(1 << len(lay.warp_bases)):
        for load in range(1 << regs - width):
            banks = {}
            for lane in range(1 << lanes):
                key, byte = _coords(bases, (warp << lanes | lane) << regs | load << width)
                word = _swizzled(key, byte, d, swizzle) // 4
                banks.setdefault(word % 32, set()).add(word)
            assert max(map(len, banks.values())) == 1, (warp, load, banks)
    shape, order = _v_relabel(d, n)
    assert order[-1] == len(order) - 1  # the keys stay where they are
    heads = np.arange(d).reshape(shape[:-1]).transpose(order[:-1]).reshape(-1)
    assert sorted(heads) == list(range(d)) and (v_rows.fn(np.arange(d), d) == heads).all()

