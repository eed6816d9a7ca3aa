"""Per-shape plans of the cross-rank merge (:mod:`paged_backend.parallel`): buffers, launch
config and the launches of one level for one (shape, dtype, out dtype, device), and the CUDA graphs
behind eager calls.

Why graphs in eager mode: an eager merge pays Python and launch overhead for the collective(s) and
the Triton kernel(s) (tens of microseconds, more than the GPU work at decode sizes). So after the
first (plain, warm-up) call of a shape, the plan's fixed sequence after the input copy -
collective(s) + kernel(s), reading the plan's staged inputs and writing a static result - is
captured once (:class:`MergeGraph`); later eager calls stage their inputs (one copy, none when the
producer wrote into the send buffer), replay the graph and copy the result out (one copy).
``parallel._Level`` decides when, and makes every rank agree that the capture worked before any
rank replays.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from paged_backend.kernels.dispatch import use_triton
from paged_backend.kernels.merge import (merge_gathered_triton, merge_torch, rows_config, weigh_finish_torch, weigh_finish_triton,
                           weigh_pack_torch, weigh_pack_triton)

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # 2.13 renamed it


class CollectiveError(RuntimeError):
    """A collective of :func:`tree_merge` (or of the ring baseline) failed: typically a peer died or
    did not join within the process group's timeout (``init_process_group(timeout=...)``)."""


def collective(what: str, fn, *args, group=None, **kwargs):
    """Runs ``fn(*args, group=group, **kwargs)``, turning backend failures into a clear
    :class:`CollectiveError` (gloo raises on a dead peer or at the group's timeout)."""
    try:
        return fn(*args, group=group, **kwargs)
    except Exception as e:  # RuntimeError / DistBackendError / DistNetworkError from the backend
        try:
            size = dist.get_world_size(group)
        except Exception:
            size = "?"
        raise CollectiveError(
            f"{what} over a group of {size} ranks failed: a peer died or did not join within the process "
            f"group's timeout ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e


def state_views(buf: torch.Tensor, shape, dtype):
    """``(o [T, H, D] dtype, lse [T, H] fp32)`` views of a uint8 buffer laid out ``[lse | o | pad]``."""
    t, h, d = shape
    lb = t * h * 4
    return buf[lb:lb + t * h * d * dtype.itemsize].view(dtype).view(t, h, d), buf[:lb].view(torch.float32).view(t, h)


def _pack(o, lse, flat, o_view, lse_view):
    """Copies a state into a ``[lse | o]`` byte buffer: one copy kernel when both are contiguous."""
    if o.is_contiguous() and lse.is_contiguous():
        torch.cat([lse.view(torch.uint8).view(-1), o.view(torch.uint8).view(-1)], out=flat)
    else:
        lse_view.copy_(lse)
        o_view.copy_(o)


class _Plan:
    """What both plans share: shape/dtypes, and the state of the eager CUDA-graph path."""
    warm = False  # a plain call of this plan has run (kernels compiled, communicator up)
    graph = None  # None: not captured yet; False: never (off, or a capture failed); else a MergeGraph

    def __init__(self, shape, dtype, out_dtype, device, graphs):
        self.shape, self.dtype, self.out_dtype, self.device = shape, dtype, out_dtype, device
        if not graphs:
            self.graph = False


class GatherPlan(_Plan):
    """Buffers and launch config of the all-gather merge for one (shape, dtype, out dtype, device).

    One rank's bytes: ``[lse fp32 | o | pad to 16 B]`` (every dtype view aligned). ``send_o`` /
    ``send_lse`` are typed views of the send buffer; ``o_all`` / ``lse_all`` per-rank strided views
    of the receive buffer, read in place by the merge kernel (no unpacking)."""
    kind = "allgather"

    def __init__(self, shape, dtype, out_dtype, device, size, graphs):
        super().__init__(shape, dtype, out_dtype, device, graphs)
        t, h, d = shape
        lb, self.n = t * h * 4, t * h * (4 + d * dtype.itemsize)
        row = -(-self.n // 16) * 16
        self.send = torch.zeros(row, dtype=torch.uint8, device=device)  # pad bytes stay 0
        self.recv = torch.zeros(size * row, dtype=torch.uint8, device=device)
        self.send_bytes = self.send[:self.n]
        self.send_o, self.send_lse = state_views(self.send, shape, dtype)
        rv = self.recv.view(size, row)
        self.lse_all = rv[:, :lb].view(torch.float32).view(size, t, h)
        self.o_all = rv[:, lb:self.n].view(dtype).view(size, t, h, d)
        self.triton = use_triton(self.send)
        self.cfg = rows_config(t * h, d)

    def buffers(self) -> dict:
        return {"send": self.send, "recv": self.recv}

    def stage(self, o, lse):
        """Packs the state into the send buffer (nothing to do when the producer wrote it there)."""
        if o is not self.send_o or lse is not self.send_lse:
            _pack(o, lse, self.send_bytes, self.send_o, self.send_lse)

    def gather(self, group):
        collective("tree_merge all_gather of [lse | o]", all_gather_flat, self.recv, self.send, group=group)

    def merge_gathered(self, out, out_lse):
        if self.triton:
            merge_gathered_triton(self.lse_all, self.o_all, out, out_lse, self.cfg)
        else:
            merge_torch(self.o_all, self.lse_all, out, out_lse)

    def body(self, group, out, out_lse):
        """Everything after :meth:`stage` (what a MergeGraph captures)."""
        self.gather(group)
        self.merge_gathered(out, out_lse)

    def run(self, o, lse, group, out, out_lse):
        self.stage(o, lse)
        self.body(group, out, out_lse)


class ReducePlan(_Plan):
    """Buffers and launch config of the all-reduce merge for one (shape, dtype, out dtype, device):
    ``m`` [T, H] (copy of lse, reduced with MAX in place) and ``buf`` [T, H, D + 1] fp32 ``[o*w | w]``
    (reduced with SUM in place). One fused kernel on each side of the SUM. The plain path reads the
    inputs where they are; the graph path first stages them in ``staged`` (made on first use)."""
    kind = "allreduce"
    staged = None  # uint8 [lse fp32 | o], viewed as in_o [T, H, D], in_lse [T, H]

    def __init__(self, shape, dtype, out_dtype, device, size, graphs):
        super().__init__(shape, dtype, out_dtype, device, graphs)
        t, h, d = shape
        self.m = torch.zeros(t, h, dtype=torch.float32, device=device)
        self.buf = torch.zeros(t, h, d + 1, dtype=torch.float32, device=device)
        self.triton = use_triton(self.buf)
        self.cfg = rows_config(t * h, d)

    def buffers(self) -> dict:
        return {"max": self.m, "sum": self.buf}

    def stage(self, o, lse):
        if self.staged is None:
            t, h, d = self.shape
            self.staged = torch.empty(t * h * (4 + d * self.dtype.itemsize), dtype=torch.uint8, device=self.device)
            self.in_o, self.in_lse = state_views(self.staged, self.shape, self.dtype)
        _pack(o, lse, self.staged, self.in_o, self.in_lse)

    def body(self, group, out, out_lse):
        self.run(self.in_o, self.in_lse, group, out, out_lse)

    def run(self, o, lse, group, out, out_lse):
        m, buf = self.m, self.buf
        m.copy_(lse).masked_fill_(m == float("inf"), float("-inf"))  # +inf marks an empty state
        collective("tree_merge all_reduce(MAX) of lse", dist.all_reduce, m, op=dist.ReduceOp.MAX, group=group)
        if self.triton:
            weigh_pack_triton(o if o.is_contiguous() else o.contiguous(),
                              lse if lse.is_contiguous() else lse.contiguous(), m, buf, self.cfg)
        else:
            weigh_pack_torch(o, lse, m, buf)
        collective("tree_merge all_reduce(SUM) of [o*w | w]", dist.all_reduce, buf, op=dist.ReduceOp.SUM,
                   group=group)
        if self.triton:
            weigh_finish_triton(buf, m, out, out_lse, self.cfg)
        else:
            weigh_finish_torch(buf, m, out, out_lse)


class MergeGraph:
    """One plan's ``body`` captured in a CUDA graph. ``replay()`` reads the plan's staged inputs and
    writes ``result`` (uint8 ``[lse fp32 | o out dtype]``, static: the next replay overwrites it)."""

    def __init__(self, plan, group):
        t, h, d = plan.shape
        self.shape, self.dtype = plan.shape, plan.out_dtype
        self.result = torch.empty(t * h * (4 + d * plan.out_dtype.itemsize), dtype=torch.uint8, device=plan.device)
        self.o, self.lse = state_views(self.result, plan.shape, plan.out_dtype)
        self.replay = self.capture(plan, group)

    def capture(self, plan, group):
        """-> the graph's replay function. Captures on a side stream in ``thread_local`` error mode
        (other threads, e.g. the NCCL watchdog, may keep calling CUDA); runs nothing; raises if the
        capture fails."""
        self.graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(plan.device)
        side.wait_stream(torch.cuda.current_stream(plan.device))
        with torch.cuda.stream(side):
            self.graph.capture_begin(capture_error_mode="thread_local")
            try:
                plan.body(group, self.o, self.lse)
            finally:
                self.graph.capture_end()  # ends the capture even when the body failed
        return self.graph.replay

    def take(self):
        """A fresh copy of the result (one copy kernel, one allocation): ``(o, lse)``, views of it."""
        return state_views(self.result.clone(), self.shape, self.dtype)

    def copy_to(self, out, out_lse):
        out.copy_(self.o)
        out_lse.copy_(self.lse)


def try_capture(plan, group):
    """A :class:`MergeGraph` of ``plan``, or ``None`` if this rank's capture failed."""
    try:
        return MergeGraph(plan, group)
    except Exception:  # noqa: BLE001 - the caller falls back to the plain path on every rank
        return None
