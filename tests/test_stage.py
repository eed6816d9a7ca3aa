"""The kernels at a decode graph's two ends (kernels/stage.py) against plain indexing: inputs read from
(pinned) host memory into a device buffer, the draw written to the device ids and a host half."""
import pytest
import torch

from paged_backend.kernels import stage
from paged_backend.kernels.dispatch import INTERPRET

pytestmark = pytest.mark.kernel

DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="Triton on the CPU: the "
                                                                               "TRITON_INTERPRET=1 pass")),
           pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                            reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_start,head_end,rows,width,cols", [(4, 4000, 5, 300, 37), (0, 9, 0, 0, 0),
                                                                 (2, 70, 3, 2100, 2100)])
def test_copy_in(device, head_start, head_end, rows, width, cols):
    """Words [head_start, head_end) as they are; each table row's first ``cols`` words from the
    compact rows after the head (their count read from the source itself), nothing else."""
    g = torch.Generator().manual_seed(head_end)
    table_at = -(-head_end // 4) * 4
    cols_at = head_end - 1 if rows else 0
    src = torch.randint(-9, 9, (table_at + rows * width,), generator=g, dtype=torch.int32)
    if rows:
        src[cols_at] = cols
    dst = torch.randint(100, 200, src.shape, generator=g, dtype=torch.int32)
    want = dst.clone()
    want[head_start:head_end] = src[head_start:head_end]
    want[table_at:].view(max(rows, 1), -1)[:rows, :cols] = src[table_at:table_at + rows * cols].view(rows, cols)
    if device == "cuda":
        src, dst = src.pin_memory(), dst.cuda()
    stage.copy_in(src, dst, head_start, head_end, table_at, rows, width, cols_at, block=256)
    assert torch.equal(dst.cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size", [1, 64, 1500])
def test_publish(device, size):
    """Tokens to the ids; tokens and log-probabilities, as float64, to the half ``parity`` names (the
    other half untouched)."""
    g = torch.Generator().manual_seed(size)
    tokens = torch.randint(0, 2 ** 40, (size,), generator=g)
    logprobs = -torch.rand(size, generator=g) * 30
    host = torch.full((2, size, 2), 7.0, dtype=torch.float64)
    if device == "cuda":
        host = host.pin_memory()
    for parity in (1, 0):
        ids = torch.zeros(size, dtype=torch.int64, device=device)
        stage.publish(tokens.to(device), logprobs.to(device), ids, torch.tensor([parity], dtype=torch.int32,
                                                                                  device=device), host)
        if device == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(ids.cpu(), tokens)
        assert torch.equal(host[parity], torch.stack([tokens.double(), logprobs.double()], 1))
        if parity:
            assert (host[0] == 7.0).all()
