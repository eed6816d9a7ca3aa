"""Exact merging of attention states ``(o, lse)`` across a process group (Tree Attention,
arXiv:2408.04093): each rank holds the state of its own disjoint key set; every rank gets the
state of the union. Natural-log LSE; an empty state (``lse = -inf``, ``o = 0``) is the identity.

Strategies (one level):

- ``"allgather"``: one all-gather of the packed bytes ``[lse | o]`` (o in its own dtype), then a
  local merge of the P states in rank order (``kernels.merge``). One collective; every rank computes
  the same bits.
- ``"allreduce"``: ``m = all_reduce(lse, MAX)``; ``w = exp(lse - m)`` (0 where ``lse = -inf``);
  one ``all_reduce(SUM)`` of the packed fp32 buffer ``[o*w | w]``; ``o = sum(o*w) / sum(w)``,
  ``lse = m + log(sum(w))``. Two collectives, but the big one is a reduction whose bytes do not
  grow with P.
- ``"auto"``: all-gather while the per-rank message (``o`` bytes + ``lse`` bytes) is at most
  :data:`ALLGATHER_MAX_BYTES` (256 KiB; env ``PAGED_BACKEND_ALLGATHER_MAX_BYTES``), else all-reduce.
  Below a few hundred KB both collectives are latency-bound (ANCHORS.md: a 4 KB and a 256 KB
  all-reduce cost the same), so one collective beats two; above it, the all-gather's P-fold volume
  and the local merge's P-fold read lose to the reduction.

Per call, :class:`TreeMerger` (what :func:`tree_merge` uses, cached per group/strategy/hierarchy)
reuses per-shape buffers and launches: all-gather = 1 pack copy + the collective + 1 merge kernel
reading the gathered buffer in place; all-reduce = 1 copy + 2 collectives + 2 fused kernels
(``kernels.merge``). No host syncs, so a warmed-up call can be captured in a CUDA graph. Eager
calls on NCCL replay a per-shape CUDA graph of that sequence (:mod:`paged_backend.parallel.merge_plans`;
see :class:`TreeMerger`).

Hierarchical: ``hierarchy=(intra, inter)`` (see :func:`make_hierarchy`) merges inside the node
group first, then across nodes; the intermediate state stays fp32. Results are deterministic for a
given group layout and strategy.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.distributed as dist

from paged_backend.kernels.checks import FLOAT_DTYPES, check_shape, check_tensor, debug_enabled
from paged_backend.parallel.merge_plans import GatherPlan, ReducePlan, all_gather_flat, collective, try_capture

STRATEGIES = ("auto", "allreduce", "allgather")
ALLGATHER_MAX_BYTES = int(os.environ.get("PAGED_BACKEND_ALLGATHER_MAX_BYTES", 256 * 1024))
MERGE_GRAPHS = os.environ.get("PAGED_BACKEND_MERGE_GRAPHS", "1") not in ("", "0")  # TreeMerger(graphs=None)


class Hierarchy(NamedTuple):
    """Two-level group spec for this rank: ``intra`` = ranks of its node, ``inter`` = the ranks with
    the same position in every node."""
    intra: object
    inter: object


def _group_ranks(group) -> list[int]:
    return list(range(dist.get_world_size())) if group is None or group is dist.group.WORLD \
        else dist.get_process_group_ranks(group)


def grid_groups(inner: int, group=None, name: str = "inner"):
    """Cuts ``group`` (ranks in order) into rows of ``inner`` consecutive ranks. Returns this rank's
    ``(row_group, column_group, index_in_row, row_index)``. Every rank of ``group`` must call it
    (groups are built with ``use_local_synchronization``, so other ranks need not)."""
    ranks = _group_ranks(group)
    if isinstance(inner, bool) or not isinstance(inner, int) or inner < 1 or len(ranks) % inner:
        raise ValueError(f"{name} must be a positive int dividing the group size {len(ranks)}, got {inner!r}")
    me = ranks.index(dist.get_rank())
    row, col = me // inner, me % inner
    row_ranks = ranks[row * inner:(row + 1) * inner]
    col_ranks = ranks[col::inner]
    for rs in (tuple(row_ranks), tuple(col_ranks)):  # rows first on every rank: no cross wait
        if rs not in _GROUPS:  # torch names these groups by their ranks: create each once
            _GROUPS[rs] = dist.new_group(list(rs), use_local_synchronization=True)
    return _GROUPS[tuple(row_ranks)], _GROUPS[tuple(col_ranks)], col, row


_GROUPS: dict = {}
_HIERARCHIES: dict = {}


def make_hierarchy(ranks_per_node: int, group=None) -> Hierarchy:
    """The two-level spec for ``group`` (default: world) with nodes of ``ranks_per_node`` consecutive
    ranks. Collective over ``group``: every member calls it once (cached after)."""
    key = (ranks_per_node, id(group))
    if key not in _HIERARCHIES:
        intra, inter, _, _ = grid_groups(ranks_per_node, group, name="ranks_per_node")
        _HIERARCHIES[key] = Hierarchy(intra, inter)
    return _HIERARCHIES[key]


def _check_args(o, lse, strategy):
    check_tensor("o", o, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("lse", lse, ndim=2, dtypes=(torch.float32,), device=o.device)
    check_shape("lse", lse, tuple(o.shape[:2]))
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


def _check_group(group, hierarchy):
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialized (call init_process_group first)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    if hierarchy is None:
        return None
    if isinstance(hierarchy, int) and not isinstance(hierarchy, bool):
        return make_hierarchy(hierarchy, group)
    if not (isinstance(hierarchy, tuple) and len(hierarchy) == 2
            and all(isinstance(g, dist.ProcessGroup) for g in hierarchy)):
        raise TypeError("hierarchy must be (intra_group, inter_group) ProcessGroups (see make_hierarchy) "
                        f"or an int ranks_per_node, got {type(hierarchy).__name__}")
    want = dist.get_world_size(group)
    got = dist.get_world_size(hierarchy[0]) * dist.get_world_size(hierarchy[1])
    if got != want:
        raise ValueError(f"hierarchy groups have {dist.get_world_size(hierarchy[0])} x "
                         f"{dist.get_world_size(hierarchy[1])} = {got} ranks but group has {want}")
    return Hierarchy(*hierarchy)


def _check_same_everywhere(o, group):
    # Debug only (one extra collective): a shape/dtype mismatch would otherwise hang or garble.
    code = FLOAT_DTYPES.index(o.dtype)
    meta = torch.tensor([*o.shape, code], dtype=torch.int64, device=o.device)
    every = torch.empty(dist.get_world_size(group) * 4, dtype=torch.int64, device=o.device)
    collective("tree_merge shape check", all_gather_flat, every, meta, group=group)
    if not bool((every.view(-1, 4) == meta).all()):
        raise ValueError(f"o: shapes/dtypes differ across ranks ([T, Hq, D, dtype] per rank: "
                         f"{every.view(-1, 4).tolist()})")


def pick_strategy(o, lse, strategy: str = "auto") -> str:
    if strategy != "auto":
        return strategy
    nbytes = o.numel() * o.element_size() + lse.numel() * 4
    return "allgather" if nbytes <= ALLGATHER_MAX_BYTES else "allreduce"


class _Level:
    """One level of the merge (one group): plans cached by (shape, dtype, out dtype, device).
    ``graphs``: eager calls may replay CUDA graphs (NCCL groups only: a gloo collective cannot be
    captured, and a failed attempt could leave peers out of step)."""

    def __init__(self, group, strategy, max_plans, graphs):
        self.group, self.strategy, self.max_plans = group, strategy, max_plans
        self.size = dist.get_world_size(group)
        self.graphs = graphs and self.size > 1 and "nccl" in str(dist.get_backend(group))
        self.plans: dict = {}

    def plan(self, shape, dtype, out_dtype, device):
        key = (shape, dtype, out_dtype, device)
        p = self.plans.get(key)
        if p is None:
            t, h, d = shape
            nbytes = t * h * (d * dtype.itemsize + 4)
            kind = self.strategy if self.strategy != "auto" else \
                ("allgather" if nbytes <= ALLGATHER_MAX_BYTES else "allreduce")
            if self.max_plans is not None and len(self.plans) >= self.max_plans:
                self.plans.pop(next(iter(self.plans)))  # oldest first
            p = self.plans[key] = (GatherPlan if kind == "allgather" else ReducePlan)(
                tuple(shape), dtype, out_dtype, device, self.size, self.graphs and device.type == "cuda")
        return p

    def replayed(self, p, o, lse) -> bool:
        """Eager fast path: stages the inputs and replays ``p.graph`` (result in ``p.graph.result``).
        False: run the plain path (graphs off, the shape's first call, a failed capture, or the
        caller is capturing a graph itself). Every rank takes the same branch: the calls of a
        collective come in the same order with the same shapes everywhere."""
        if p.graph is False or torch.cuda.is_current_stream_capturing():
            return False
        if p.graph is None:
            if not p.warm:
                p.warm = True
                return False
            p.stage(o, lse)
            p.graph = self._capture(p)
            if not p.graph:
                return False
        else:
            p.stage(o, lse)
        p.graph.replay()
        return True

    def _capture(self, p):
        # Once per shape: every rank must have a graph before any replays one (else a replayed
        # collective meets a plain one or none), so agree with one all-reduce and one host sync.
        g = try_capture(p, self.group)
        ok = torch.tensor([g is not None], dtype=torch.int32, device=p.device)
        collective("tree_merge CUDA-graph capture agreement", dist.all_reduce, ok, op=dist.ReduceOp.MIN,
                   group=self.group)
        return g if bool(ok.item()) else False

    def merge(self, o, lse, out_dtype, plan=None):
        if self.size == 1:
            return o.to(out_dtype), lse
        p = plan or self.plan(o.shape, o.dtype, out_dtype, o.device)
        if self.replayed(p, o, lse):
            return p.graph.take()  # a copy: the static result is overwritten by the next replay
        out = torch.empty(o.shape, dtype=out_dtype, device=o.device)
        out_lse = torch.empty(lse.shape, dtype=torch.float32, device=o.device)
        p.run(o, lse, self.group, out, out_lse)
        return out, out_lse

    def merge_into(self, o, lse, out, out_lse):
        """Merge writing into given contiguous outputs (the next level's send views)."""
        p = self.plan(o.shape, o.dtype, out.dtype, o.device)
        if self.replayed(p, o, lse):
            p.graph.copy_to(out, out_lse)
        else:
            p.run(o, lse, self.group, out, out_lse)


class TreeMerger:
    """Reusable :func:`tree_merge` for one group (keep one per group in an engine).

    Construction validates the group/hierarchy once and resolves per-level world sizes; each call
    then looks its buffers up by (shape, dtype, device): send/receive buffers, their typed views and
    the kernels' launch config are made on the first call of a shape and reused after (no
    allocation but the two outputs, no host sync, so a call can be captured in a CUDA graph once
    warmed up). Per call and level: ``allgather`` = 1 pack copy + 1 all-gather + 1 merge kernel;
    ``allreduce`` = 1 copy + all_reduce(MAX) + 1 pack kernel + all_reduce(SUM) + 1 finish kernel.
    A hierarchical merge writes the intra-node result straight into the inter-node all-gather's send
    buffer. ``max_plans`` bounds the shapes cached per level (oldest dropped; ``None``: unbounded -
    use that, or a bound above the number of captured shapes, when calls are captured in CUDA graphs,
    since a graph keeps using the buffers it captured). Not thread-safe; one stream at a time.

    ``graphs`` (default: env ``PAGED_BACKEND_MERGE_GRAPHS``, on unless ``0``): eager calls on an
    NCCL group replay a per-shape CUDA graph instead of launching the collective(s) and kernel(s)
    from Python. The first call of a shape runs plain (compiles the kernels, brings the communicator
    up); the second captures the sequence after the input copy - collective(s) + kernel(s) writing a
    static result - and all ranks agree on the outcome (one small all-reduce and one host sync per
    shape; if any rank failed, every rank keeps the plain path for that shape). Later calls cost one
    input copy (none for :meth:`send_views` inputs) + one graph launch + one copy of the result into
    a fresh tensor. That last copy is the price of safety: returning the static result would let the
    next call overwrite what the caller holds; a caller that wants no copies at all captures its
    whole step in a CUDA graph (inside a capture this path is off and the kernels write straight into
    the outputs). Trade-offs: a replayed collective is not tracked by c10d's NCCL watchdog, so a dead
    peer hangs the call instead of timing out (set ``graphs=False`` where that matters); each cached
    shape holds one graph and one result buffer; the setting must be the same on every rank.
    """

    def __init__(self, group=None, *, strategy: str = "auto", hierarchy=None, max_plans: int | None = 64,
                 graphs: bool | None = None):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if max_plans is not None and (isinstance(max_plans, bool) or not isinstance(max_plans, int)
                                      or max_plans < 1):
            raise ValueError(f"max_plans must be a positive int or None, got {max_plans!r}")
        if graphs is not None and not isinstance(graphs, bool):
            raise TypeError(f"graphs must be a bool or None, got {type(graphs).__name__}")
        self.hierarchy = _check_group(group, hierarchy)
        self.group, self.strategy = group, strategy
        graphs = MERGE_GRAPHS if graphs is None else graphs
        if self.hierarchy is None:
            self.levels = (_Level(group, strategy, max_plans, graphs),)
        else:
            self.levels = (_Level(self.hierarchy.intra, strategy, max_plans, graphs),
                           _Level(self.hierarchy.inter, strategy, max_plans, graphs))

    def merge(self, o: torch.Tensor, lse: torch.Tensor, *, check: bool = True):
        """:func:`tree_merge` of ``(o, lse)`` over this merger's group. ``check=False`` skips the
        argument checks (for callers whose tensors are known to be well formed)."""
        if check:
            _check_args(o, lse, self.strategy)
        if debug_enabled():
            _check_same_everywhere(o, self.group)
        if o.numel() == 0:
            return o.clone(), lse.clone()
        if len(self.levels) == 1:
            return self.levels[0].merge(o, lse, o.dtype)
        intra, inter = self.levels
        if inter.size == 1:
            return intra.merge(o, lse, o.dtype)
        if intra.size == 1:  # same bits as converting to fp32 first: the kernels compute in fp32
            return inter.merge(o, lse, o.dtype)
        mid = torch.float32  # the intermediate state stays fp32: a bf16 input is rounded once
        p2 = inter.plan(o.shape, mid, o.dtype, o.device)
        if intra.size > 1 and p2.kind == "allgather":  # write the node's state into the next send buffer
            intra.merge_into(o, lse, p2.send_o, p2.send_lse)
            return inter.merge(p2.send_o, p2.send_lse, o.dtype, p2)
        o1, lse1 = intra.merge(o, lse, mid)
        return inter.merge(o1, lse1, o.dtype, p2)

    __call__ = merge

    def send_views(self, shape, dtype, device):
        """``(o [T, Hq, D], lse [T, Hq])`` views of the all-gather send buffer for inputs of this
        shape/dtype, or ``None`` when that shape uses the all-reduce (or is hierarchical/size 1). A
        producer that writes its state into them and passes these very tensors to :meth:`merge`
        saves the pack copy."""
        lvl = self.levels[0]
        if len(self.levels) != 1 or lvl.size == 1 or any(s == 0 for s in shape):
            return None
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        p = lvl.plan(torch.Size(shape), dtype, dtype, device)
        return (p.send_o, p.send_lse) if p.kind == "allgather" else None

    def buffers(self) -> list:
        """``[(level, kind, shape, {name: tensor})]`` of the cached buffers (tests, diagnostics)."""
        return [(i, p.kind, key[0], p.buffers()) for i, lvl in enumerate(self.levels)
                for key, p in lvl.plans.items()]


_MERGERS: dict = {}
_MAX_MERGERS = 32


def get_merger(group=None, *, strategy: str = "auto", hierarchy=None) -> TreeMerger:
    """The cached :class:`TreeMerger` that :func:`tree_merge` uses for these arguments."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialized (call init_process_group first)")
    try:  # None means the current default group: a re-initialised world gets a new merger
        key = (dist.group.WORLD if group is None else group, strategy, hierarchy)
        m = _MERGERS.get(key)
    except TypeError:  # unhashable hierarchy: let the constructor name the problem
        return TreeMerger(group, strategy=strategy, hierarchy=hierarchy)
    if m is None:
        m = TreeMerger(group, strategy=strategy, hierarchy=hierarchy)
        if len(_MERGERS) >= _MAX_MERGERS:
            _MERGERS.pop(next(iter(_MERGERS)))
        _MERGERS[key] = m
    return m


def tree_merge(o: torch.Tensor, lse: torch.Tensor, group=None, *, strategy: str = "auto", hierarchy=None):
    """Merge the attention states of all ranks of ``group`` (default: world); every rank gets the result.

    o [T, Hq, D] (fp16/bf16/fp32), lse [T, Hq] float32 natural log, the same shapes and dtype on every
    rank (checked with ``PAGED_BACKEND_DEBUG=1``). Returns ``(o [T, Hq, D] in o's dtype, lse [T, Hq]
    float32)``; rows empty on every rank give o = 0, lse = -inf. ``strategy``: "auto", "allreduce" or
    "allgather" (module docstring); ``hierarchy``: ``(intra_group, inter_group)`` from
    :func:`make_hierarchy`, or an int ranks-per-node (groups built on first use, collectively).
    A dead or late peer raises :class:`CollectiveError` once the group's timeout expires (gloo; with
    NCCL the watchdog aborts at its timeout).
    """
    _check_args(o, lse, strategy)
    return get_merger(group, strategy=strategy, hierarchy=hierarchy).merge(o, lse, check=False)
