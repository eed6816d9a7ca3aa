"""integration/vllm/host_tables.py: block-table rows by request slot, a step late, without a sync."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_backend.integration.vllm.host_tables import HostTables

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_rows_by_slot_as_the_last_step_left_them(device):
    """Each slot's row comes from the last step that sent it (slots in any order, a view of a wider
    table); a slot never sent holds nothing; rows are held up to their blocks and never past a null
    block (vLLM's block 0); the table grows to slots and widths not seen before."""
    h = HostTables()
    wide = torch.tensor([[7, 8, 9, 0, 5], [3, 4, 0, 0, 6], [11, 12, 13, 14, 2]], dtype=torch.int32, device=device)
    h.send(wide[:, :4], np.array([4, 1, 9]), np.array([3, 2, 4]))  # slots 4, 1, 9
    table, held = h.take(np.array([9, 4, 2, 1]), 4)
    assert table[[0, 1, 3]].tolist() == [[11, 12, 13, 14], [7, 8, 9, 0], [3, 4, 0, 0]]
    assert held.tolist() == [4, 3, 0, 2]
    # the next step: slot 4 grew a block; slot 1 left and slot 30 holds a dummy's null table
    h.send(torch.tensor([[7, 8, 9, 21, 22], [0, 0, 0, 0, 0]], dtype=torch.int32, device=device), np.array([4, 30]),
           np.array([5, 3]))
    table, held = h.take(np.array([4, 30, 1, 9]), 6)
    assert table[0, :5].tolist() == [7, 8, 9, 21, 22] and held.tolist() == [5, 0, 2, 4]
    _, held = h.take(np.array([4]), 3)  # (fewer columns than held: held within them)
    assert held.tolist() == [3]


@pytest.mark.gpu
def test_a_copy_still_queued_is_waited_for():
    """A step's copy queued behind GPU work is taken once that work is done (counted in ``waits``),
    with the table as the step left it, not as later writes to the device table made it."""
    h = HostTables()
    table = torch.arange(1, 13, dtype=torch.int32, device="cuda").view(3, 4)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued before the copy
    h.send(table, np.array([0, 1, 2]), np.array([4, 4, 4]))
    table.fill_(99)  # the next step rewrites the device table (queued after the copy)
    rows, held = h.take(np.array([2, 0]), 4)
    assert h.waits == 1 and rows.tolist() == [[9, 10, 11, 12], [1, 2, 3, 4]] and held.tolist() == [4, 4]
