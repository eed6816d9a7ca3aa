"""Public cascade (shared-prefix) decode: ``plan_cascade`` once per step, ``cascade_decode`` per layer.

A prefix shared by n requests (found from identical leading block ids, or given by the scheduler
as groups) is read once and attended by all n requests as one tensor-core GEMM, spread stream-K
over the GPU; each request's private tail runs as decode; the states merge exactly. See
docs/cascade.md and :mod:`paged_backend.cascade.plan` (the plan itself; its arguments are checked here).
"""
from __future__ import annotations

import numpy as np
import torch

from paged_backend.kernels.cascade import cascade_torch, cascade_triton
from paged_backend.kernels.checks import (HEAD_DIMS, check_attention_inputs, check_heads, check_plan_matches,
                                         check_kv_scales, check_plan_window, check_sinks, check_softcap,
                                         check_window)
from paged_backend.kernels.decode import decode_triton
from paged_backend.kernels.dispatch import use_triton
from paged_backend.cascade.arena import CascadeArena
from paged_backend.cascade.plan import CascadeCost, CascadePlan, build_plan

__all__ = ["CascadePlan", "CascadeCost", "plan_cascade", "cascade_decode"]


def cascade_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cplan: CascadePlan,
                   return_lse: bool = True, scale: float | None = None, *, softcap: float | None = None,
                   sinks: torch.Tensor | None = None, window: int | None = None, k_scale=None, v_scale=None):
    """Decode attention of one query token per request, sharing the plan's prefixes.

    q [B, Hq, D]; k_cache, v_cache [NB, BS, Hkv, D] (any strides); ``cplan`` from
    :func:`plan_cascade` for this step (it holds the block table and lengths). Returns
    ``(out [B, Hq, D] in q's dtype, lse [B, Hq] float32 natural log)``, or ``out`` alone when
    ``return_lse=False``. A request of length 0 gives out = 0, lse = -inf. Exact (equal to flat
    decode up to rounding) and deterministic. ``softcap``, ``sinks``, ``window``, ``k_scale``,
    ``v_scale`` (fp8 caches): as in :func:`paged_decode`; the plan must be made with the same ``window``.
    """
    softcap = check_softcap(softcap)
    window = check_window(window)
    if not isinstance(cplan, CascadePlan):
        raise TypeError(f"cplan must be a CascadePlan from pb.plan_cascade, got {type(cplan).__name__}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    nb, bs, hkv, d, hq, scale = check_attention_inputs(q, k_cache, v_cache, scale)
    batch = q.shape[0]
    check_plan_matches("cplan", cplan, q.device, batch_size=batch, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                       block_size=bs)
    check_plan_window("cplan", cplan, window)
    if cplan.max_block_id >= nb:
        raise ValueError(f"cplan's block table uses block id {cplan.max_block_id} but k_cache holds {nb} blocks")
    sinks = check_sinks(sinks, hq, q.device)
    scales = check_kv_scales(k_cache, k_scale, v_scale)
    out = torch.empty(batch, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, hq, dtype=torch.float32, device=q.device)
    if use_triton(q):
        if cplan.is_flat:
            decode_triton(q, k_cache, v_cache, cplan.views["block_table"], cplan.views["seq_lens"],
                          cplan.flat_plan, scale, out, lse, softcap, sinks, scales)
        else:
            cascade_triton(q, k_cache, v_cache, cplan, scale, out, lse, softcap, sinks, scales)
    else:
        cascade_torch(q, k_cache, v_cache, cplan, scale, out, lse, softcap, sinks, scales)
    return (out, lse) if return_lse else out


def _positive_int(name, val):
    if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
        raise ValueError(f"{name} must be a positive int, got {val!r}")
    return int(val)


def _host_array(name, x, ndim):
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ValueError(f"{name} must be a host (CPU) tensor or numpy array; got a tensor on {x.device} "
                             "(keep a host copy of the metadata; the plan copies it to the device once)")
        x = x.numpy()
    arr = np.asarray(x)
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got {arr.dtype}")
    return arr


def plan_cascade(block_table_cpu, seq_lens_cpu, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, device=None, groups=None, cost: CascadeCost | None = None,
                 node_programs: int | None = None, leaf_programs: int | None = None,
                 block_table_device: torch.Tensor | None = None, forest: CascadePlan | None = None,
                 forest_rows=None, window: int | None = None, arena: CascadeArena | None = None,
                 host_lens=None) -> CascadePlan:
    """Plan one cascade decode step from host metadata (see module doc).

    ``block_table_cpu [B, max_blocks]`` and ``seq_lens_cpu [B]``: host (CPU tensor / numpy) copies.
    ``groups``: optional explicit groups from the scheduler (lists of batch indices, nested or
    disjoint); their common leading full blocks are verified and only those are shared. ``cost``:
    the :class:`CascadeCost` deciding which nodes pay off. ``node_programs`` / ``leaf_programs``
    override the persistent grids (default SMs x occupancy). ``block_table_device``: the same table
    already on ``device`` (int32, any strides): the kernels read it instead of a fresh copy.
    ``forest``: the plan of an earlier step whose shared blocks are unchanged, as in decode steps that
    only append private blocks: its nodes are reused (finding and verifying the forest is most of
    the cost), and its partition too where only the tails' lengths changed (the same requests with
    tails, one piece each); else the partition is redone. Without ``forest_rows`` the batch is the
    same (same requests in the same order). ``forest_rows [B]``: the batch lost requests since (or
    was reordered): each request's batch index in ``forest``'s step, distinct; its nodes are kept
    with the members left (see :mod:`paged_backend.cascade.reuse`). ``-1`` marks a request new since
    then: with one, the forest is found anew (as without ``forest``). Each request must still hold
    its shared blocks in full, and every member's last shared block is compared with its node's (the
    whole shared ranges with ``PAGED_BACKEND_DEBUG=1``).

    ``window``: the sliding window of the layers the plan serves (see :func:`paged_decode`). Each
    node starts at its members' earliest window block, a node no member's window reaches is
    dropped, and tails start at ``max(shared_len, len - window)``: the work follows the windows.
    ``forest`` must have been planned with the same window.

    ``arena``: a :class:`~paged_backend.cascade.arena.CascadeArena` on ``device`` to upload the plan
    into (needs ``block_table_device``): plans of one arena whose ``launch_key()`` is equal launch
    the same kernels with the same arguments, so one CUDA graph of ``cascade_decode`` serves them all.
    A plan that does not fit comes back with ``arena`` None (in fresh buffers).

    ``host_lens [B]``: the tokens of each row whose block ids ``block_table_cpu`` holds, where it holds
    fewer than ``seq_lens_cpu`` (a host copy made a step before, as the vLLM plug-in keeps one; default:
    all). Only those blocks are read on the host - to find and check the shared blocks, which are then
    at most those - and the kernels read every block from ``block_table_device`` (required with it).
    """
    window = check_window(window) or None
    table = _host_array("block_table_cpu", block_table_cpu, 2)
    lens = _host_array("seq_lens_cpu", seq_lens_cpu, 1).astype(np.int64)
    for name, val in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads),
                      ("head_dim", head_dim), ("block_size", block_size)):
        _positive_int(name, val)
    check_heads(num_q_heads, num_kv_heads)
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    if block_size > 256 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two in 1..256, got {block_size}")
    if table.shape[0] != lens.size:
        raise ValueError(f"block_table_cpu has {table.shape[0]} rows but seq_lens_cpu has {lens.size} entries")
    if lens.size and lens.min() < 0:
        raise ValueError(f"seq_lens_cpu must be >= 0, got min {lens.min()}")
    if lens.size and lens.max() > table.shape[1] * block_size:
        raise ValueError(f"seq_lens_cpu max {lens.max()} exceeds the block table's capacity "
                         f"{table.shape[1]} blocks x {block_size}")
    if cost is None:
        cost = CascadeCost()
    elif not isinstance(cost, CascadeCost):
        raise TypeError(f"cost must be a CascadeCost or None, got {type(cost).__name__}")
    for name, val in (("node_programs", node_programs), ("leaf_programs", leaf_programs)):
        if val is not None:
            _positive_int(name, val)
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif not isinstance(device, torch.device):
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device must be a torch.device or device string, got {device!r}") from e
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if host_lens is not None:
        host_lens = _host_array("host_lens", host_lens, 1).astype(np.int64)
        if host_lens.size != lens.size or (host_lens.size and host_lens.min() < 0):
            raise ValueError(f"host_lens must hold one count >= 0 per row ({lens.size}), got shape {host_lens.shape}")
        if block_table_device is None:
            raise ValueError("host_lens needs block_table_device: the kernels read the blocks past host_lens there")
        host_lens = np.minimum(host_lens, lens)
    if block_table_device is not None:
        if not isinstance(block_table_device, torch.Tensor):
            raise TypeError(f"block_table_device must be a torch.Tensor, got {type(block_table_device).__name__}")
        if block_table_device.dtype != torch.int32 or block_table_device.device != device \
                or block_table_device.dim() != 2 or block_table_device.shape[0] != lens.size \
                or block_table_device.shape[1] < min(table.shape[1], -(-int(lens.max() if lens.size else 0) // block_size)):
            raise ValueError("block_table_device must be an int32 [B, >= blocks in use] tensor on "
                             f"{device} holding block_table_cpu's ids")
    if arena is not None:
        if not isinstance(arena, CascadeArena):
            raise TypeError(f"arena must be a CascadeArena or None, got {type(arena).__name__}")
        if block_table_device is None or arena.device != device:
            raise ValueError(f"arena needs block_table_device (the kernels' table at a fixed address) and must "
                             f"be on {device}, got block_table_device={'None' if block_table_device is None else 'set'}"
                             f" and an arena on {arena.device}")
    rows = None
    if forest is not None:
        rows = _check_forest(forest, groups, forest_rows, lens.size, num_q_heads=num_q_heads,
                             num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, window=window)
        if rows is not None and rows.size and rows.min() < 0:  # a request new since: find the forest anew
            forest, rows = None, None
    elif forest_rows is not None:
        raise ValueError("forest_rows needs forest (the plan whose batch it indexes)")
    return build_plan(table, lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      block_size=block_size, device=device, groups=groups, cost=cost,
                      node_programs=node_programs, leaf_programs=leaf_programs,
                      block_table_device=block_table_device, forest=forest, forest_rows=rows, window=window,
                      arena=arena, host_lens=host_lens)


def _check_forest(forest, groups, forest_rows, batch: int, **shape):
    """``forest`` (an earlier CascadePlan) fits this step: same shapes, and the same batch or, with
    ``forest_rows``, a batch of some of its requests. -> the rows as int64 (None: the same batch).
    Whether the shared blocks still hold is checked on the nodes reused (``check_held``)."""
    if not isinstance(forest, CascadePlan):
        raise TypeError(f"forest must be a CascadePlan from pb.plan_cascade, got {type(forest).__name__}")
    if groups is not None:
        raise ValueError("give groups or forest, not both (forest reuses an earlier plan's nodes)")
    for name, want in shape.items():
        if getattr(forest, name) != want:
            raise ValueError(f"forest was planned with {name}={getattr(forest, name)}, this step has {want}")
    if forest_rows is None:
        if forest.batch_size != batch:
            raise ValueError(f"forest was planned with batch_size={forest.batch_size}, this step has {batch} "
                             "(for a batch that lost requests, give forest_rows)")
        return None
    rows = _host_array("forest_rows", forest_rows, 1)
    if rows.size != batch:
        raise ValueError(f"forest_rows must have one entry per request ({batch}), got {rows.size}")
    rows = rows.astype(np.int64)
    if rows.size and (rows.min() < -1 or rows.max() >= forest.batch_size):
        raise ValueError(f"forest_rows must hold forest's batch indices in [0, {forest.batch_size}), "
                         "or -1 for a request new since")
    seen = np.zeros(forest.batch_size, dtype=bool)
    old = rows[rows >= 0]
    seen[old] = True
    if np.count_nonzero(seen) != old.size:
        raise ValueError("forest_rows repeats a batch index")
    if rows.size == forest.batch_size and np.array_equal(rows, np.arange(rows.size)):
        return None  # the same batch: its partition may be copied too
    return rows


def cascade_node_kernel_name(q, k_cache, v_cache, cplan, softcap: float = 0.0, scales=(None, None)) -> str:
    """Which kernel runs ``cplan``'s node pieces in :func:`cascade_decode`: ``"sm90"`` (Gluon,
    Hopper), ``"sm90+tails"`` (the same kernel running the private tails too, one launch before the
    merge), ``"portable"`` (Triton) or ``"torch"``. Benchmarks print it."""
    from paged_backend.kernels.cascade import node_sm90_config, runs_tails
    from paged_backend.kernels.dispatch import use_triton
    if q.is_cuda and node_sm90_config(q, k_cache, v_cache, cplan, softcap, scales) is not None:
        return "sm90+tails" if runs_tails(cplan, q) else "sm90"
    return "portable" if use_triton(q) else "torch"
