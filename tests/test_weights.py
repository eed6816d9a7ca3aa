"""WeightWatch: what changed in a model's tensors since the last look."""
from __future__ import annotations

import torch

from paged_backend.integration.weights import WeightWatch


def test_updates_in_place_change_and_re_pointed_tensors_move():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    watch = WeightWatch(model)
    assert watch.look() == (False, False)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # an optimizer's step
    assert watch.look() == (True, False) and watch.look() == (False, False)
    model.load_state_dict({k: v + 1 for k, v in model.state_dict().items()})
    assert watch.look() == (True, False)
    model[1].running_mean.mul_(2)  # a buffer
    assert watch.look() == (True, False)
    model[0].bias.data = torch.zeros(4)  # re-pointed
    assert watch.look() == (True, True) and watch.look() == (False, False)
    model[0].weight.data.copy_(torch.ones(4, 4))  # through .data: no version bump (documented)
    assert watch.look() == (False, False)
