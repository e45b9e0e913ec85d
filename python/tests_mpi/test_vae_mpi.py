"""diffcp.vae at P ranks (mpirun -np P python -m pytest python/tests_mpi): the patch-parallel decode
of a Wan 2.1 VAE equals the one-process decode, and each rank's bytes equal the closed form
(diffcp.vae.wan_decode_bytes). CI has no diffusers: the VAE is standin_wan_vae's test double (the
decoder's classes by name and its cache protocol, random weights); tools/diffusers_pipeline_check.py
--family wan runs the same decode on diffusers' own AutoencoderKLWan."""
import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")

import diffcp.vae  # noqa: E402
from standin_wan_vae import AutoencoderKLWan  # noqa: E402

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()


def _latent(shape, seed: int):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# 7 rows: P = 2, 3, 4 split them unevenly (4/3, 3/2/2, 2/2/2/1); 3 latent frames: the causal
# convolutions' caches and the temporal upsamplers' "Rep" first call both run; 2 videos a batch.
# wan22: the Wan 2.2 VAE's decoder (residual up blocks with DupUp3D shortcuts, patch_size 2: 16x).
@pytest.mark.parametrize("shape,wan22", [((1, 4, 3, 7, 5), False), ((2, 4, 2, 4, 6), False), ((1, 4, 3, 7, 5), True)])
def test_patch_parallel_decode_equals_one_process(shape, wan22):
    vae = AutoencoderKLWan(seed=1, **(dict(is_residual=True, patch_size=2) if wan22 else {}))
    z = _latent(shape, 2)
    with torch.no_grad():
        want = vae.decode(z, return_dict=False)[0]
    T, s = shape[2], 16 if wan22 else 8
    assert tuple(want.shape) == (shape[0], 3, 1 + 4 * (T - 1), s * shape[3], s * shape[4])
    assert float(((want > -1) & (want < 1)).float().mean()) > 0.5  # the clamp hides little
    dec = diffcp.vae.PatchParallelDecoder(vae, COMM)
    got = dec.decode(z, return_dict=False)[0]
    err = float((got - want).abs().max())
    assert err <= 1e-5, f"rank {RANK}: max |diff| {err}"
    assert dec.stats == diffcp.vae.wan_decode_bytes(vae.config, z.shape, P, RANK)
    assert all(type(m).forward is not None and "forward" not in m.__dict__ for m in vae.modules())  # unpatched
    with torch.no_grad():  # and the VAE decodes as before
        assert torch.equal(vae.decode(z, return_dict=False)[0], want)


def test_without_halos_the_decode_is_wrong():
    # Negative control: the rows' neighbours matter (halos replaced by zeros must differ at P >= 2).
    if P == 1:
        pytest.skip("no neighbours at P = 1")
    vae = AutoencoderKLWan(seed=1)
    z = _latent((1, 4, 2, 6, 5), 3)
    with torch.no_grad():
        want = vae.decode(z, return_dict=False)[0]
    dec = diffcp.vae.PatchParallelDecoder(vae, COMM)
    real = dec._halo
    dec._halo = lambda x, r, dim: tuple(torch.zeros_like(h) for h in real(x, r, dim))
    got = dec.decode(z, return_dict=False)[0]
    assert float((got - want).abs().max()) > 1e-2


def test_closed_form_counts():
    # By hand for the double's shape (base 8, mult 1 2 2 2, 1 residual block pair, z 4) at P = 3, rank 1
    # (two neighbours), z [1, 4, 3, 6, 5]: levels w 5, 10, 20, 40 with frames 3, 5, 9, 9.
    c = AutoencoderKLWan().config
    halo = 2 * (4 * 3 * 5 + 4 * 16 * 3 * 5  # conv_in, the mid block's four
                + (16 + 16 + 16 + 16) * 3 * 5 + 16 * 5 * 10  # up block 0, its upsampler (3-D: 2 T - 1)
                + (8 + 16 + 16 + 16) * 5 * 10 + 16 * 9 * 20  # up block 1, its upsampler (3-D)
                + (8 + 16 + 16 + 16) * 9 * 20 + 16 * 9 * 40  # up block 2, its upsampler (2-D)
                + (8 + 8 + 8 + 8) * 9 * 40 + 8 * 9 * 40)  # up block 3 (8 channels out), conv_out
    want = {"halo": 4 * halo, "attention": 4 * 2 * 16 * 3 * 2 * 5, "output": 4 * 2 * 3 * 9 * 16 * 40}
    assert diffcp.vae.wan_decode_bytes(c, (1, 4, 3, 6, 5), 3, 1) == want
    assert diffcp.vae.row_split(7, 3) == [3, 2, 2]
    # The Wan 2.2 VAE's residual up blocks read their input's channels whole (16, 16, 16, 16: not halved
    # after the first), their upsamplers keep them, and the output is 12 channels at 8x = 3 at 16x.
    c = AutoencoderKLWan(is_residual=True, patch_size=2).config
    halo = 2 * (4 * 3 * 5 + 4 * 16 * 3 * 5
                + (16 + 16 + 16 + 16) * 3 * 5 + 16 * 5 * 10
                + (16 + 16 + 16 + 16) * 5 * 10 + 16 * 9 * 20
                + (16 + 16 + 16 + 16) * 9 * 20 + 16 * 9 * 40
                + (16 + 8 + 8 + 8) * 9 * 40 + 8 * 9 * 40)
    want = {"halo": 4 * halo, "attention": 4 * 2 * 16 * 3 * 2 * 5, "output": 4 * 2 * 3 * 9 * 32 * 80}
    assert diffcp.vae.wan_decode_bytes(c, (1, 4, 3, 6, 5), 3, 1) == want


def test_bad_input_is_refused():
    with pytest.raises(NotImplementedError, match="AutoencoderKL is not supported"):
        diffcp.vae.PatchParallelDecoder(type("AutoencoderKL", (), {})(), COMM)
    odd = AutoencoderKLWan()
    odd.decoder.up_blocks[0].extra = torch.nn.GroupNorm(2, 16)  # mixes rows: must be refused
    with pytest.raises(NotImplementedError, match="GroupNorm, which this patch-parallel decode does not know"):
        diffcp.vae.PatchParallelDecoder(odd, COMM)
    hooked = AutoencoderKLWan()
    conv = hooked.decoder.conv_in
    conv.forward = lambda *a, **k: type(conv).forward(conv, *a, **k)  # as offloading / casting hooks do
    with pytest.raises(NotImplementedError, match="carries a hook"):
        diffcp.vae.PatchParallelDecoder(hooked, COMM)
    vae = AutoencoderKLWan()
    dec = diffcp.vae.PatchParallelDecoder(vae, COMM)
    with pytest.raises(ValueError, match="expected \\[B, z_dim, T, h, w\\]"):
        dec.decode(torch.zeros(1, 4, 6, 5))
    if P > 1:
        with pytest.raises(ValueError, match=f"a latent of {P - 1} rows cannot split over {P} ranks"):
            dec.decode(torch.zeros(1, 4, 2, P - 1, 5))
    vae.use_tiling = True
    with pytest.raises(NotImplementedError, match="tiling"):
        dec.decode(torch.zeros(1, 4, 2, 6, 5))
