"""Fixed device buffers for cascade plans, so that one CUDA graph replays many steps' plans.

A plan's kernels read everything that changes between decode steps (the pieces, their token
ranges, the merge lists, the lengths) from its int32 buffer and its partial-state buffers; the
launches fix only the grids, tile sizes and a few counts (:meth:`CascadePlan.launch_key`). A plan
made with ``plan_cascade(..., arena=arena)`` is staged in the arena's layout on the host and copied
into its buffers, each part at a fixed offset with room to grow, instead of fresh ones: a graph
captured with one such plan replays correctly with any later plan of the same arena and launch key.
The block table is not a part: the caller passes it on the device at a fixed address
(``block_table_device``).

A plan that does not fit (more pieces or slots than the arena has room for) is uploaded into fresh
buffers as usual and its ``arena`` is None; :meth:`CascadeArena.grown_for` makes an arena with room
for it (graphs of the old one must then be captured anew).

A *fixed* arena (:meth:`CascadeArena.for_graphs`) goes further, for runners that keep one CUDA graph
per batch size whatever the step (vLLM's full decode graphs): every plan made in it launches the
same kernels for a batch size - the node, tail and merge launches always (on empty lists where a
step has no node or no tail), a node tile fixed per batch size, no Hopper fused lists, a fixed fold
tile - and a step with no node that pays, or one too big for the arena, is planned as tails only
(every request's keys as decode pieces) instead of as a flat decode. Its room is sized up front for
the largest batch: the parts of one batch size's plan sit at the same offsets as another's, so one
arena serves every size (graphs replay one at a time on a stream).
"""
from __future__ import annotations

import torch

from paged_backend.kernels import stage

# room made for each part (and the partial states): this many times a plan's need, plus a little
HEADROOM = 2
ALIGN = 4  # int32 entries: each part starts 16-byte aligned (as Triton specializes pointers)
# a fixed arena's room for node memberships a row (for_graphs), and its fold tile's list length
# (lists are a tail's pieces after a node's each: 2-4 slots in the forests it has room for)
MEMBERSHIPS_PER_ROW = 2
FIXED_FOLD_LEN = 4


class CascadeArena:
    """One int32 device buffer cut into named parts of fixed capacity, and fp32 partial states.

    ``capacity``: {part: int32 entries}; ``slots``: partial states ``[slots, group, head_dim]``.
    ``fixed``: plans launch alike per batch size (see the module doc; made by :meth:`for_graphs`)."""

    def __init__(self, capacity: dict[str, int], slots: int, group: int, head_dim: int, device: torch.device,
                 fixed: bool = False):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # (as plan_cascade names it: plans check it)
            device = torch.device("cuda", torch.cuda.current_device())
        self.capacity, self.slots, self.device, self.fixed = dict(capacity), int(slots), device, fixed
        self.offsets, at = {}, 0
        for name, n in self.capacity.items():
            self.offsets[name] = at
            at += -(-n // ALIGN) * ALIGN
        self.size = at
        self.buffer = torch.zeros(max(1, at), dtype=torch.int32, device=self.device)
        self.partial_o = torch.empty(self.slots, group, head_dim, dtype=torch.float32, device=self.device)
        self.partial_lse = torch.empty(self.slots, group, dtype=torch.float32, device=self.device)
        self._views: tuple = ((), {})  # the last send's (sizes, views): steady steps keep their sizes
        # the longest merge list of the first plan made in it: every plan's fold loads that many states
        # at once (longer lists take more rounds), so a forest whose lists change keeps its launches
        self.fold_len = FIXED_FOLD_LEN if fixed else 0
        self.pinned, self.consumed = None, None  # (read_in_graph)

    @classmethod
    def for_graphs(cls, max_batch: int, *, num_q_heads: int, num_kv_heads: int, head_dim: int, device,
                   node_programs: int | None = None, leaf_programs: int | None = None) -> CascadeArena:
        """A fixed arena with room for the plans of up to ``max_batch`` rows (the module doc):
        tails-only plans always fit, and cascade plans of up to ``MEMBERSHIPS_PER_ROW`` node
        memberships a row (a forest two levels deep: a prompt, then groups of its samples) do; a
        plan with more is planned as tails only. ``node_programs``/``leaf_programs``: as
        ``plan_cascade``'s (the plans made in it must give the same)."""
        from paged_backend.cascade.partition import graph_capacity
        device = torch.device(device)
        cap, slots = graph_capacity(max_batch, num_q_heads, num_kv_heads, head_dim, device, node_programs,
                                    leaf_programs, MEMBERSHIPS_PER_ROW)
        return cls(cap, slots, num_q_heads // num_kv_heads, head_dim, device, fixed=True)

    @classmethod
    def grown_for(cls, plan, old: CascadeArena | None = None) -> CascadeArena:
        """An arena with room for ``plan``'s parts and slots (``HEADROOM`` times), and at least the
        room of ``old``."""
        cap = {name: HEADROOM * v.size + 2 * ALIGN for name, v in plan.host.items() if name != "block_table"}
        slots = HEADROOM * max(1, plan.num_slots)
        if old is not None:  # (old's parts the plan lacks kept too: plans of the other kind fit again)
            cap = {name: max(cap.get(name, 0), old.capacity.get(name, 0)) for name in {**old.capacity, **cap}}
            slots = max(slots, old.slots)
        group = plan.num_q_heads // plan.num_kv_heads
        return cls(cap, slots, group, plan.head_dim, plan.device)

    def fits(self, sizes: dict[str, int], slots: int, group: int, head_dim: int) -> bool:
        """Whether parts of these ``sizes`` (int32 entries) and ``slots`` partial states fit."""
        return (self.partial_o.shape[1:] == (group, head_dim) and slots <= self.slots
                and all(self.capacity.get(name, -1) >= n for name, n in sizes.items()))

    def stage(self, sizes: dict[str, int]) -> tuple[torch.Tensor, dict]:
        """A fresh host buffer in the arena's layout (pinned for a CUDA arena: the host may fill the
        next step's while this one's copy waits in the stream), zeros, and the views of its parts
        ``{name: int32 numpy view of sizes[name] entries}`` to fill before :meth:`send`."""
        src = torch.zeros(self.size, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        host = src.numpy()
        return src, {name: host[self.offsets[name]:self.offsets[name] + n] for name, n in sizes.items()}

    def part(self, name: str, n: int) -> torch.Tensor:
        """The device view of part ``name``'s first ``n`` entries."""
        return self.buffer[self.offsets[name]:self.offsets[name] + n]

    def read_in_graph(self, consumed: torch.cuda.Event | None) -> None:
        """From now on :meth:`send` leaves the plans in pinned memory, which :meth:`copy_in` reads into
        the device buffer as the first step of a CUDA graph (``integration/static_inputs.py``: no copy
        between two graphs). ``consumed``: an event the graph records after its ``copy_in``, which
        ``send`` waits for before it writes again (None on the CPU)."""
        self.pinned = torch.zeros(self.size, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self.consumed = consumed

    def copy_in(self) -> None:
        """The last :meth:`send`'s plan into the device buffer (after :meth:`read_in_graph`)."""
        if not self.size:
            return
        if self.buffer.is_cuda:
            stage.copy_in(self.pinned, self.buffer, 0, self.size)
        else:
            self.buffer[:self.size] = self.pinned

    def send(self, src: torch.Tensor, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
        """Copies a filled :meth:`stage` buffer to the arena (one copy; after :meth:`read_in_graph`
        into its pinned memory) -> {name: device view of its first ``sizes[name]`` entries} (the last
        send's views where the sizes are the same: a tensor view costs host time, several
        microseconds on some hosts)."""
        if self.pinned is None:
            self.buffer[:self.size].copy_(src, non_blocking=True)
        else:
            if self.consumed is not None:
                self.consumed.synchronize()  # (the last graph has read the last send)
            self.pinned.copy_(src)  # (not staged in place: a plan keeps its staging's views, a later one reads them)
        key = tuple(sizes.items())
        if key != self._views[0]:
            self._views = key, {name: self.buffer[self.offsets[name]:self.offsets[name] + n] for name, n in key}
        return dict(self._views[1])
