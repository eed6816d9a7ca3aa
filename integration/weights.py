"""What changed in a model's tensors between two engine calls (RL loops update the weights they
sample from): an update in place bumps a tensor's version counter (``copy_``, ``load_state_dict``, an
optimizer's step, under ``no_grad`` or not; not writes through ``.data``); a re-pointed tensor
(``p.data = t``, ``load_state_dict(assign=True)``, ``model.to``) has a new address, which CUDA graphs
captured before do not follow. ~0.5 us a tensor."""
from __future__ import annotations

import torch


class WeightWatch:
    """The addresses and versions of ``model``'s parameters and buffers when last looked at."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.state = _state(model)

    def look(self) -> tuple[bool, bool]:
        """-> (whether any tensor changed since the last look, whether any moved)."""
        state = _state(self.model)
        moved = state[0] != self.state[0]
        changed = moved or state[1] != self.state[1]
        self.state = state
        return changed, moved


def _state(model: torch.nn.Module) -> tuple[list[int], list[int]]:
    ts = [*model.parameters(), *model.buffers()]
    return [t.data_ptr() for t in ts], [t._version for t in ts]
