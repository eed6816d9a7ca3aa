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
"""
from __future__ import annotations

import torch

# room made for each part (and the partial states): this many times a plan's need, plus a little
HEADROOM = 2
ALIGN = 4  # int32 entries: each part starts 16-byte aligned (as Triton specializes pointers)


class CascadeArena:
    """One int32 device buffer cut into named parts of fixed capacity, and fp32 partial states.

    ``capacity``: {part: int32 entries}; ``slots``: partial states ``[slots, group, head_dim]``."""

    def __init__(self, capacity: dict[str, int], slots: int, group: int, head_dim: int, device: torch.device):
        self.capacity, self.slots, self.device = dict(capacity), int(slots), torch.device(device)
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
        self.fold_len = 0

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

    def send(self, src: torch.Tensor, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
        """Copies a filled :meth:`stage` buffer to the arena (one copy) -> {name: device view of its
        first ``sizes[name]`` entries} (the last send's views where the sizes are the same: a tensor
        view costs host time, several microseconds on some hosts)."""
        self.buffer[:self.size].copy_(src, non_blocking=True)
        key = tuple(sizes.items())
        if key != self._views[0]:
            self._views = key, {name: self.buffer[self.offsets[name]:self.offsets[name] + n] for name, n in key}
        return dict(self._views[1])
