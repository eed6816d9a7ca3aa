"""gumbel_argmax and gumbel_sample (kernels/gumbel.py) against their torch versions: the same tokens
(bitwise on the GPU) and log-probabilities; the noise finite for every hash (keys crafted to hit the
last bucket); bad inputs refused with the argument named. (The draws' distribution: test_sampler.)"""
import pytest
import torch

from paged_backend.gumbel import M32, gumbel_argmax, gumbel_argmax_torch, gumbel_sample, gumbel_sample_torch, mix32, vocab_hash

pytestmark = pytest.mark.kernel


def _inputs(s, v, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s, v, generator=g) * 3
    x[torch.rand(s, v, generator=g) < 0.3] = float("-inf")  # filtered tokens
    x[:, 0] = 0.0  # every row keeps a token
    keys = torch.randint(0, 2 ** 32, (s,), generator=g, dtype=torch.int64)
    return x.to(device), keys.to(device), vocab_hash(v, device)


def _values(x, keys, vh):
    """The torch version's perturbed logits [S, V]."""
    u = ((mix32(keys[:, None] ^ vh[None, :]) >> 9).float() + 0.5) * (1.0 / (1 << 23))
    return x - torch.log(-torch.log(u))


def unmix32(h: int) -> int:
    """The inverse of mix32 on one uint32: the input whose hash is ``h``."""
    h ^= h >> 16
    h = (h * pow(0xC2B2AE35, -1, 1 << 32)) & M32
    h ^= (h >> 13) ^ (h >> 26)
    h = (h * pow(0x85EBCA6B, -1, 1 << 32)) & M32
    return h ^ (h >> 16)


def key_hitting(h: int, token: int, vh: torch.Tensor) -> int:
    """A row key whose hash for ``token`` is ``h``."""
    return unmix32(h) ^ int(vh[token])


def _last_bucket_draws(device):
    """Rows whose key puts one token's hash at 0xFFFFFFFF (the largest u): that token must not win
    unless its logit does. Row 0: token 0 the only real candidate (others at -40), the hit on 37;
    row 1: token 37 filtered (-inf), the others equal; row 2: the hit on the kept token 5 of a row
    where only 5 and 9 are left."""
    v = 64
    vh = vocab_hash(v, device)
    x = torch.full((3, v), -40.0)
    x[0, 0] = 0.0
    x[1] = 0.0
    x[1, 37] = float("-inf")
    x[2] = float("-inf")
    x[2, 5] = x[2, 9] = 0.0
    keys = torch.tensor([key_hitting(M32, 37, vh), key_hitting(M32, 37, vh), key_hitting(M32, 5, vh)],
                        dtype=torch.int64, device=device)
    hits = mix32(keys[:, None] ^ vh[None, [37, 37, 5]]).diagonal()
    assert hits.tolist() == [M32] * 3  # the crafted keys reach the last bucket
    assert torch.isfinite(_values(torch.zeros(3, v, device=device), keys, vh)).all()
    return gumbel_argmax(x.to(device), keys, vh).tolist()


def test_the_last_bucket_gives_finite_noise():
    got = _last_bucket_draws("cpu")
    assert got[0] == 0 and got[1] != 37 and got[2] == 5


@pytest.mark.parametrize("s,v", [(1, 1), (3, 100), (5, 4099), (2, 8192)])
def test_draws_match_the_torch_version(s, v):
    """The same token, except (under the interpreter, whose numpy log may round the last bit
    otherwise) where the two tokens' values tie within rounding."""
    x, keys, vh = _inputs(s, v, seed=s * 7 + v)
    got, want = gumbel_argmax(x, keys, vh), gumbel_argmax_torch(x, keys, vh)
    val = _values(x, keys, vh)
    best = val.gather(1, want[:, None])[:, 0]
    picked = val.gather(1, got[:, None])[:, 0]
    assert got.dtype == torch.int64 and got.shape == (s,)
    assert torch.all((got == want) | ((best - picked).abs() <= 1e-5 * best.abs().clamp(min=1.0)))


def _check_sample(logits, temp, keys, vh, rtol):
    """gumbel_sample's tokens are the two-step draw's (up to ties within ``rtol`` of the values), its
    log-probabilities log_softmax's."""
    got, lp = gumbel_sample(logits, temp, keys, vh)
    x = logits.float()
    scaled = x / temp[:, None]
    want = gumbel_argmax_torch(scaled, keys, vh)
    val = _values(scaled, keys, vh)
    best, picked = val.gather(1, want[:, None])[:, 0], val.gather(1, got[:, None])[:, 0]
    assert got.dtype == torch.int64 and got.shape == want.shape
    assert torch.all((got == want) | ((best - picked).abs() <= rtol * best.abs().clamp(min=1.0)))
    ref = torch.log_softmax(x.double(), -1).gather(1, got[:, None])[:, 0]
    assert torch.allclose(lp.double(), ref, atol=1e-5, rtol=1e-5), (lp, ref)
    return got, lp


@pytest.mark.parametrize("s,v,dtype", [(1, 1, torch.float32), (3, 100, torch.float32), (5, 4099, torch.float32),
                                       (4, 9000, torch.bfloat16)])
def test_sample_is_the_draw_over_logits_by_temperature(s, v, dtype):
    """The one-pass draw (raw logits of any float dtype, a temperature per row) against logits.float()
    / T drawn by the torch version; bf16 runs the torch path under the interpreter (it has no bf16)."""
    x, keys, vh = _inputs(s, v, seed=s + v)
    x[x == float("-inf")] = -30.0  # raw logits: no filter
    temp = torch.linspace(0.3, 1.7, s)
    _check_sample(x.to(dtype), temp, keys, vh, rtol=1e-5)


def test_ties_go_to_the_lowest_token_and_filtered_rows_keep_their_token():
    v = 5000
    x = torch.full((2, v), float("-inf"))
    x[0, 3] = x[0, 4100] = 0.0  # row 0: two tokens left; row 1: one
    x[1, 4500] = 1.0
    keys = torch.tensor([7, 9], dtype=torch.int64)
    vh = torch.zeros(v, dtype=torch.int64)  # every token the same noise: row 0's two values tie
    assert gumbel_argmax(x, keys, vh).tolist() == [3, 4500]


def test_bad_inputs_are_named():
    x, keys, vh = _inputs(2, 10, seed=0)
    with pytest.raises(TypeError, match="x must have dtype"):
        gumbel_argmax(x.double(), keys, vh)
    with pytest.raises(ValueError, match="keys must have 2 entries"):
        gumbel_argmax(x, keys[:1], vh)
    with pytest.raises(TypeError, match="vocab_hash must have dtype"):
        gumbel_argmax(x, keys, vh.int())
    with pytest.raises(ValueError, match="at least one column"):
        gumbel_argmax(x[:, :0], keys, vh[:0])
    temp = torch.ones(2)
    with pytest.raises(TypeError, match="logits must have dtype"):
        gumbel_sample(x.long(), temp, keys, vh)
    with pytest.raises(ValueError, match="temperature must have 2 entries"):
        gumbel_sample(x, temp[:1], keys, vh)
    with pytest.raises(TypeError, match="temperature must have dtype"):
        gumbel_sample(x, temp.double(), keys, vh)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_the_last_bucket_gives_finite_noise():
    got = _last_bucket_draws("cuda")
    assert got[0] == 0 and got[1] != 37 and got[2] == 5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_draws_are_the_torch_versions_bits():
    """64 rows over a 128K vocabulary on the GPU: the fused kernel picks the torch version's tokens."""
    x, keys, vh = _inputs(64, 128256, seed=3, device="cuda")
    for t in (1.0, 0.7):
        xs = x / t
        assert torch.equal(gumbel_argmax(xs, keys, vh), gumbel_argmax_torch(xs, keys, vh))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_sample_is_the_torch_versions_bits(dtype):
    """64 rows of raw logits over a 128K vocabulary, a temperature per row: the one-pass kernel draws
    the torch version's tokens bit for bit (IEEE division, libdevice's log) and log_softmax's
    log-probabilities; the same for a strided view of the rows."""
    x, keys, vh = _inputs(64, 128256, seed=5, device="cuda")
    x = torch.where(torch.isinf(x), torch.full_like(x, -20.0), x).to(dtype)
    temp = torch.linspace(0.25, 2.0, 64, device="cuda")
    got, lp = _check_sample(x, temp, keys, vh, rtol=0.0)
    assert torch.equal(got, gumbel_sample_torch(x, temp, keys, vh)[0])
    wide = torch.zeros(64, 128256 + 64, dtype=dtype, device="cuda")
    wide[:, :128256] = x
    assert torch.equal(gumbel_sample(wide[:, :128256], temp, keys, vh)[0], got)
