"""Shared benchmark helpers: timing, copy bandwidth, paged inputs, dense reference, result files.

Every benchmark script imports this module (``benchmarks/`` is on ``sys.path`` when a script in it
runs). Times are microseconds: on CUDA medians of ``triton.testing.do_bench``'s loop with the L2
evicted by a read before each timed call (:func:`time_us`), on the CPU of ``time.perf_counter`` loops.
"""
from __future__ import annotations

import datetime
import itertools
import json
import math
import os
import platform
import re
import sys
import time
from dataclasses import dataclass, field

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MB = 1e6
ROTATE_BELOW = 200 * MB  # an input set smaller than this is rotated with copies of itself ...
ROTATE_TOTAL = 256 * MB  # ... until the copies together span this many bytes (L2: 50 MB)
MAX_SETS = 16


# ----------------------------------------------------------------------------- timing
_FLUSH: dict = {}


def flush_l2(device) -> None:
    """Evicts the L2 by reading 256 MB, leaving it full of clean lines. ``triton.testing.do_bench``
    zeroes 256 MB instead, which leaves it full of dirty ones: the timed call then pays their
    write-back, ~10 us on an H200 for a kernel at full bandwidth and nothing for one well below it
    (B1x32K decode, ours 50.3 -> 40.4 us, FlashInfer 60.7 -> 59.9 us with this flush; a flush by
    zeroing then reading: 41.2 / 59.3 us; results/sweeps/eager_flush_h200.log)."""
    buf = _FLUSH.get(device)
    if buf is None:
        buf = _FLUSH[device] = torch.zeros(128 << 20, dtype=torch.float16, device=device)
    torch.amax(buf)


def time_us(fn, device, warmup_ms: int = 50, rep_ms: int = 200, cpu_reps: int = 3) -> float:
    """Median time of ``fn()`` in microseconds. CUDA: ``do_bench``'s loop (a call, five timed to size
    the warm-up and the repeats, then per repeat: L2 flush, start event, call, end event) with
    :func:`flush_l2` as the flush; events made before the loop."""
    if torch.device(device).type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device()) if torch.device(device).index is None \
            else torch.device(device)
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            flush_l2(device)
            fn()
        end.record()
        torch.cuda.synchronize()
        estimate_ms = start.elapsed_time(end) / 5
        n_warmup, n_repeat = max(1, int(warmup_ms / estimate_ms)), max(1, int(rep_ms / estimate_ms))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
        for _ in range(n_warmup):
            fn()
        for s, e in zip(starts, ends):
            flush_l2(device)
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
        return times[len(times) // 2] * 1e3
    fn()
    times = []
    for _ in range(cpu_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e6


def host_time_us(fn, calls: int = 200) -> float:
    """Median wall time of a host-side call (no GPU sync), microseconds."""
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e6


def graph_time_us(fns, warmup_ms: int = 50, rep_ms: int = 200, calls: int = 10) -> float:
    """Median time per call of ``fns`` replayed from one CUDA graph, in microseconds: the kernels'
    time without Python launch overhead, as a serving engine sees it when it captures a decode step
    of many layers. The graph holds ``calls`` calls (at least one per input set), cycling through
    the input sets so the L2 cannot serve a repeat. Each fn is warmed up on a side stream first."""
    seq = [fns[i % len(fns)] for i in range(max(calls, len(fns)))]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in seq:
            fn()
    torch.cuda.synchronize()
    return time_us(graph.replay, "cuda", warmup_ms, rep_ms) / len(seq)


def rotate(fns):
    """One callable that runs the next of ``fns`` on each call (input sets rotated past the L2)."""
    if len(fns) == 1:
        return fns[0]
    it = itertools.cycle(fns)
    return lambda: next(it)()


def copy_bandwidth(device, nbytes: int | None = None) -> float:
    """Device-to-device copy GB/s, read + write counted (2 x buffer bytes per copy)."""
    device = torch.device(device)
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), device, cpu_reps=5)
    del src, dst
    return 2 * nbytes / (us * 1e-6) / 1e9


# ----------------------------------------------------------------------------- inputs
@dataclass
class PagedInputs:
    """Shared metadata plus ``n`` sets of (q, k_cache, v_cache) with identical shapes.

    All sets use the same shuffled ``block_table`` (so one plan serves them all); only the data
    buffers differ, which is what keeps the L2 from holding them between timed calls.
    """
    lens: list
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device
    block_table: torch.Tensor  # [B, max_blocks] int32, pages shuffled
    seq_lens: torch.Tensor  # [B] int32 on device
    sets: list = field(default_factory=list)  # [(q [B, Hq, D], k [NB, BS, Hkv, D], v)]
    window: int | None = None  # sliding window: each request attends its last `window` keys
    kv_dtype: torch.dtype | None = None  # the cache's dtype when not q's (fp8)

    @property
    def kv_bytes(self) -> int:
        """KV bytes that must be read at least once: sum(keys attended) * Hkv * D * 2 (K and V) * elt."""
        elt = (self.kv_dtype or self.dtype).itemsize
        keys = sum(min(n, self.window or n) for n in self.lens)
        return keys * self.num_kv_heads * self.head_dim * 2 * elt

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


def make_paged_inputs(lens, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype,
                      device, seed: int = 0, rotate_sets: bool = True, window: int | None = None,
                      kv_dtype: torch.dtype | None = None) -> PagedInputs:
    """``kv_dtype``: a cache dtype other than q's ``dtype`` (fp8: values of N(0, 1) rounded, scales 1.0)."""
    device = torch.device(device)
    lens = [int(n) for n in lens]
    need = [-(-n // block_size) for n in lens]
    nb = sum(need) + 1  # one spare block: unused table entries point at it
    gen = torch.Generator(device="cpu").manual_seed(seed)
    perm = torch.randperm(nb, generator=gen).to(torch.int32)
    cols = max(need + [1])
    table = torch.full((len(lens), cols), int(perm[-1]), dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at:at + n]
        at += n
    set_bytes = 2 * nb * block_size * num_kv_heads * head_dim * (kv_dtype or dtype).itemsize
    n_sets = 1
    if rotate_sets and device.type == "cuda" and set_bytes < ROTATE_BELOW:
        n_sets = max(1, min(MAX_SETS, math.ceil(ROTATE_TOTAL / set_bytes)))
    inp = PagedInputs(lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device,
                      table.to(device), torch.tensor(lens, dtype=torch.int32, device=device), window=window,
                      kv_dtype=kv_dtype)
    torch.manual_seed(seed)
    shape = (nb, block_size, num_kv_heads, head_dim)
    for _ in range(n_sets):
        q = torch.randn(len(lens), num_q_heads, head_dim, device=device).to(dtype)
        k = torch.randn(shape, dtype=dtype, device=device).to(kv_dtype or dtype)
        v = torch.randn(shape, dtype=dtype, device=device).to(kv_dtype or dtype)
        inp.sets.append((q, k, v))
    return inp


def gather_request(cache: torch.Tensor, block_table: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """Dense ``[n, Hkv, D]`` rows of request ``b`` from a ``[NB, BS, Hkv, D]`` cache."""
    bs = cache.shape[1]
    pos = torch.arange(n, device=cache.device)
    pages = block_table[b].long()[pos // bs]
    if cache.element_size() == 1:  # fp8: gathered as bytes (torch's CUDA indexing has no fp8 kernels)
        return cache.view(torch.uint8)[pages, pos % bs].view(cache.dtype)
    return cache[pages, pos % bs]


def check_rows(lens) -> list:
    """Requests checked against the reference: first, middle, last and the longest."""
    b = len(lens)
    return sorted({0, b // 2, b - 1, max(range(b), key=lambda i: lens[i])})


def reference(inp: PagedInputs, rows, scale: float | None = None):
    """fp64 dense attention of set 0 on ``rows`` (over each one's window, if any) -> (o [R, Hq, D],
    lse [R, Hq], natural log)."""
    q, k_cache, v_cache = inp.sets[0]
    d, hkv, g = inp.head_dim, inp.num_kv_heads, inp.group
    scale = d ** -0.5 if scale is None else scale
    outs, lses = [], []
    for b in rows:
        n = inp.lens[b]
        lo = max(0, n - inp.window) if inp.window else 0
        k = gather_request(k_cache, inp.block_table, b, n)[lo:].double()
        v = gather_request(v_cache, inp.block_table, b, n)[lo:].double()
        qb = q[b].double().view(hkv, g, d)
        s = torch.einsum("hgd,nhd->hgn", qb, k) * scale
        lse = torch.logsumexp(s, dim=-1)
        o = torch.einsum("hgn,nhd->hgd", torch.exp(s - lse[..., None]), v)
        outs.append(o.reshape(hkv * g, d))
        lses.append(lse.reshape(hkv * g))
        del k, v, s
    return torch.stack(outs), torch.stack(lses)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    den = ref.norm().item()
    num = (out - ref).norm().item()
    return num / den if den > 0 else num


def free_memory():
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- environment
def gpu_name(device=None) -> str:
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def gpu_slug(device=None) -> str:
    """Short file-name tag: 'h100', 'h200', 'a100', ..., or 'cpu'."""
    if not (torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")):
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    m = re.search(r"\b([abhlgt]\d{2,3}|rtx\s*\d{4}|mi\d{3}x?)\b", name)
    return re.sub(r"\W+", "", m.group(1)) if m else re.sub(r"\W+", "_", name).strip("_")


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("triton", "flashinfer", "xformers"):
        m = sys.modules.get(mod)
        if m is None and mod == "triton":
            import triton as m
        if m is not None:
            out[mod] = getattr(m, "__version__", "?")
    out["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET", "0")
    return out


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# ----------------------------------------------------------------------------- result files
def write_json(path: str, bench: str, payload: dict) -> None:
    """Merge ``payload`` as ``benchmarks[bench]`` into the JSON file at ``path``."""
    data = {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = {}
    data.setdefault("benchmarks", {})[bench] = payload
    data["updated"] = now()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=False, default=str)
    os.replace(tmp, path)


def parser(doc: str) -> "argparse.ArgumentParser":
    """A small benchmark's command line: ``--quick`` (a CPU smoke run) and where its results go
    (``--out``/``--md``, read by :func:`save_results`); the benchmark adds its own options."""
    import argparse
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small shapes (CPU smoke run)")
    p.add_argument("--out", help="results JSON (default benchmarks/results/<gpu>.json; none with --quick)")
    p.add_argument("--md", help="markdown (default benchmarks/results/<gpu>.md)")
    return p


def save_results(device, bench: str, cases: dict, text: str, out: str | None = None, md: str | None = None) -> None:
    """A small benchmark's results: ``{"when", "gpu", "versions", "cases"}`` into the JSON file
    (default ``benchmarks/results/<gpu>.json``) and ``text`` as its section of the markdown file."""
    slug = gpu_slug(device)
    write_json(out or os.path.join(ROOT, "benchmarks", "results", f"{slug}.json"), bench,
               {"when": now(), "gpu": gpu_name(device), "versions": versions(), "cases": cases})
    write_md_section(md or os.path.join(ROOT, "benchmarks", "results", f"{slug}.md"), bench, text)


def md_table(header, rows) -> str:
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)


def write_md_section(path: str, bench: str, text: str, title: str = "Benchmark results") -> None:
    """Replace (or append) the section of ``bench`` between marker comments in ``path``."""
    begin, end = f"<!-- begin {bench} -->", f"<!-- end {bench} -->"
    doc = f"# {title}\n\n"
    if os.path.exists(path):
        with open(path) as f:
            doc = f.read()
    block = f"{begin}\n{text.rstrip()}\n{end}"
    if begin in doc and end in doc:
        pre, rest = doc.split(begin, 1)
        doc = pre + block + rest.split(end, 1)[1]
    else:
        doc = doc.rstrip() + "\n\n" + block + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(doc)


def short_error(e: BaseException, limit: int = 300) -> str:
    msg = f"{type(e).__name__}: {e}".replace("\n", " ")
    return msg if len(msg) <= limit else msg[:limit] + "..."
