"""The sampler's Triton kernels compiled for an H100/H200 (sm_90a) on the CPU, as the GPU would
compile them: the launchers run on CPU tensors with each kernel launch recorded instead of run,
and every recorded launch goes through Triton's compiler and ptxas (both ship with Triton).

Why: CI runs these kernels under ``TRITON_INTERPRET=1``, which executes them as numpy and never
type-checks them as the compiler does - a variable whose type changed in a branch ran under the
interpreter and failed to compile on the H200 (2026-11-29, ``kernels/top_p.py``). Register
spills are checked too: a spill in the draw's inner loop would cost every sampled step."""
import re
import subprocess

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

from paged_backend.kernels.dispatch import INTERPRET

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
    ptx = kernel.asm["ptx"]
    info = subprocess.run([get_ptxas(TARGET.arch).path, "-v", "--gpu-name", "sm_90a", "-", "-o", "/dev/null"],
                          input=ptx, capture_output=True, text=True, check=True).stderr
    return " ".join(line.split("info    :")[-1].strip() for line in info.splitlines() if "spill" in line or "registers" in line)


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
