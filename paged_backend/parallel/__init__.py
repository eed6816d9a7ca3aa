"""Attention across GPUs: ``tree`` merges states ``(o, lse)`` over a process group (Tree
Attention), ``context`` shards paged KV along the sequence and decodes with it (context
parallelism, a TP x CP mesh, the ring baseline), ``merge_plans`` holds the merges' per-shape
buffers and CUDA graphs. See docs/parallel.md.
"""
from paged_backend.parallel.context import (Mesh, Placement, cp_cascade_decode, cp_decode, make_mesh,
                                            ring_bytes_per_step, ring_decode, shard_paged_kv, tp_head_slices)
from paged_backend.parallel.merge_plans import CollectiveError
from paged_backend.parallel.tree import (ALLGATHER_MAX_BYTES, STRATEGIES, Hierarchy, TreeMerger, get_merger,
                                         make_hierarchy, pick_strategy, tree_merge)

__all__ = ["tree_merge", "TreeMerger", "get_merger", "make_hierarchy", "Hierarchy", "pick_strategy", "STRATEGIES",
           "ALLGATHER_MAX_BYTES", "CollectiveError", "Placement", "shard_paged_kv", "cp_decode",
           "cp_cascade_decode", "Mesh", "make_mesh", "tp_head_slices", "ring_decode", "ring_bytes_per_step"]
