"""Cascade (shared-prefix) decode: ``plan_cascade`` once per step, ``cascade_decode`` per layer.

Modules: ``ops`` (the two public ops and their argument checks), ``plan`` (the plan and its cost
model), ``forest`` (sharing found from the block tables), ``reuse`` (a forest kept across decode
steps), ``planner`` (plans step after step from the last one's forest), ``partition`` (the stream-K
work split and the device buffers), ``merge_lists`` (each request's partial slots in fold order), ``fused``
(how plans are cut for the Hopper kernels: tiles, fused lists, lockstep, the tails' grid), ``arena`` (fixed
device buffers: one CUDA graph for many steps' plans).
See docs/cascade.md.
"""
from paged_backend.cascade.arena import CascadeArena
from paged_backend.cascade.ops import (CascadeCost, CascadePlan, cascade_decode, cascade_node_kernel_name,
                                       plan_cascade)

__all__ = ["CascadeArena", "CascadePlan", "CascadeCost", "plan_cascade", "cascade_decode", "cascade_node_kernel_name"]
