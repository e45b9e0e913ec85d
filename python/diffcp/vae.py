"""Patch-parallel decode of Wan's video VAE (diffusers' ``AutoencoderKLWan``, issue #70).

The decode is the largest memory of a Wan pipeline after the transformer: its activations run at
the output's resolution with 96-384 channels, for every frame the causal convolutions keep. Here
the latent's rows (height) are split over the P ranks of a communicator, each rank runs diffusers'
own decoder modules on its rows, and what the rows need from their neighbours crosses ranks:

  * every convolution with a kernel taller than one row (the decoder's causal 3 x 3 x 3
    ``WanCausalConv3d``s, the upsamplers' 3 x 3 ``Conv2d``s) first receives its ``r`` halo rows (r = 1,
    the padding) from the rank above and the rank below (zeros at the video's top and bottom edge,
    as the convolution's zero padding). A frame's halo crosses once: the causal convolutions'
    cached frames (the last two of each convolution's input) keep their halo rows here, beside the
    cache diffusers keeps of the rank's own rows;
  * the mid block's spatial self-attention (``WanAttentionBlock``, at the latent's resolution)
    all-gathers its input's rows, attends over the whole frame and keeps its own rows;
  * the decoded rows are all-gathered at the end: every rank returns the whole video.

Nothing else in the decoder mixes rows (RMS norms over channels, SiLU, nearest 2x upsampling, the
temporal convolutions with one-row kernels, the 1 x 1 x 1 shortcuts; the Wan 2.2 VAE's DupUp3D
shortcuts, which spread each row's channels over its 2 output rows, and its final unpatchify, each
row into patch_size rows), so the decode equals
diffusers' one-process decode up to float rounding (the convolutions see other shapes). Each
rank's activations at the upsampled sizes, the bulk of the decode's memory, are its rows plus two
halo rows a convolution: they fall as 1/P. Whole on every rank stay the mid block's attention (at
the latent's size: (h w)^2 scores a frame) and the decoded video that the last all-gather brings.

The bytes each rank sends are in a closed form (:func:`wan_decode_bytes`, with the VAE's element
size: 4 for f32, 2 for bf16) and counted (:attr:`PatchParallelDecoder.stats`); the test
(python/tests_mpi) and tools/diffusers_pipeline_check.py compare the two. Supported: the Wan 2.1 VAE
(Wan 2.1 and Wan 2.2 A14B pipelines) and the Wan 2.2 VAE of TI2V-5B (``is_residual``: residual up
blocks; ``patch_size``); not tiling; on the CPU, without hooks on the
decoder (CPU offload, layerwise casting: refused). Every rank calls ``decode`` with the same latent
(a pipeline's ranks hold the same latents): it is collective. The halo exchange uses mpi4py on a
duplicate of the communicator given; an error inside the decode (after the checks, which fail alike on every rank)
aborts the job (``MPI_Abort``) with the message rather than leave the other ranks waiting.
"""
from __future__ import annotations

import sys

__all__ = ["PatchParallelDecoder", "wan_decode_bytes", "row_split"]

# The decoder's module classes; anything else in the decoder is refused (a diffusers release that
# adds a row-mixing layer must not decode silently wrong). Row-local: they act per row (or per pixel).
_LOCAL = {"WanDecoder3d", "WanMidBlock", "WanResidualBlock", "WanUpBlock", "WanResample", "WanUpsample", "WanRMS_norm",
          "WanResidualUpBlock", "DupUp3D", "SiLU", "Dropout", "Identity", "ModuleList", "Sequential"}
_CACHE_T = 2  # frames a causal convolution keeps of its input (diffusers' CACHE_T)


def row_split(rows: int, P: int) -> list[int]:
    """The latent rows of each rank: rows // P each, the first rows % P ranks one more."""
    return [rows // P + (1 if p < rows % P else 0) for p in range(P)]


def wan_decode_bytes(config, z_shape, P: int, p: int, itemsize: int = 4) -> dict[str, int]:
    """The bytes rank p of P sends in a patch-parallel decode of the latent z [B, z_dim, T, h, w].

    halo: every convolution with a 3-row kernel sends one row of each frame of its input to each
    neighbour (n_p of them: 2 inside, 1 at an edge), r C_in W_l T_l bytes a neighbour: the decoder's
    conv_in (z_dim channels at the latent's size), the mid block's 4 (dims[0]), each up block's
    2 (num_res_blocks + 1) (its first conv1 reads in_dim: dims[i], halved after the first block in the
    Wan 2.1 VAE, not in the Wan 2.2 VAE's residual blocks; the rest out_dim), each upsampler's Conv2d
    (out_dim channels at the doubled size), conv_out (the last out_dim). T_l: the frames at a level
    (T at the latent's; an upsample3d makes 2 T_l - 1: the first chunk's frame stays one);
    W_l = w 2^level.
    attention: the mid block's all-gather, the rank's rows [B, dims[0], T, h_p, w] to P - 1 ranks.
    output: the decoded rows [B, 3, T_out, s h_p, s w] to P - 1 ranks (s = 8; the Wan 2.2 VAE: 16, its
    out_channels 3 p^2 unpatchified into p x p pixels)."""
    B, _, T, h, w = (int(v) for v in z_shape)
    rows = row_split(h, P)[p]
    nb = (p > 0) + (p < P - 1)
    mult = list(config.dim_mult)
    base = getattr(config, "decoder_base_dim", None) or config.base_dim
    dims = [base * u for u in [mult[-1]] + mult[::-1]]
    up_time = list(config.temperal_downsample)[::-1]
    halo = 0

    def conv(c_in: int, frames: int, width: int) -> None:
        nonlocal halo
        halo += nb * B * c_in * frames * width

    t_l, w_l = T, w
    conv(config.z_dim, t_l, w_l)  # conv_in
    for _ in range(4):  # mid block: two residual blocks, two convs each
        conv(dims[0], t_l, w_l)
    out_dim = dims[0]
    for i in range(len(mult)):
        in_dim, out_dim = (dims[i] // 2 if i > 0 and not getattr(config, "is_residual", False) else dims[i]), dims[i + 1]
        conv(in_dim, t_l, w_l)
        conv(out_dim, t_l, w_l)
        for _ in range(config.num_res_blocks):
            conv(out_dim, t_l, w_l)
            conv(out_dim, t_l, w_l)
        if i != len(mult) - 1:
            if up_time[i]:
                t_l = 2 * t_l - 1
            w_l *= 2
            conv(out_dim, t_l, w_l)  # the upsampler's Conv2d after the nearest 2x
    conv(out_dim, t_l, w_l)  # conv_out
    scale = 2 ** (len(mult) - 1)
    attention = (P - 1) * B * dims[0] * T * rows * w
    output = (P - 1) * B * config.out_channels * t_l * (scale * rows) * (scale * w)
    return {"halo": halo * itemsize, "attention": attention * itemsize, "output": output * itemsize}


def _nbytes(t) -> int:
    return t.numel() * t.element_size()  # (Tensor.nbytes is newer than Debian's torch 1.13)


def _np(t):
    """A contiguous CPU tensor as a numpy array sharing its memory (bf16 as its 16-bit pattern)."""
    import torch
    t = t.contiguous()
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


class PatchParallelDecoder:
    """``decode(z, return_dict=True)`` with AutoencoderKLWan.decode's arguments and result, the rows
    split over ``comm``'s ranks. ``stats``: this rank's bytes sent by the last decode (halo,
    attention, output), equal to :func:`wan_decode_bytes`."""

    def __init__(self, vae, comm):
        import torch
        name = type(vae).__name__
        if name != "AutoencoderKLWan":
            raise NotImplementedError(f"diffcp.vae: a patch-parallel decode of {name} is not supported (Wan's video "
                                      "VAE, AutoencoderKLWan, is)")
        self.vae, self.comm = vae, comm
        self.P, self.p = comm.Get_size(), comm.Get_rank()
        self.stats = {"halo": 0, "attention": 0, "output": 0}
        self._convs, self._attn = [], []
        for mod in vae.decoder.modules():
            cls = type(mod).__name__
            if cls == "WanCausalConv3d":
                if mod.stride[1] != 1 or mod._padding[2] != (mod.kernel_size[1] - 1) // 2:
                    raise NotImplementedError(f"diffcp.vae: a causal convolution with kernel {mod.kernel_size}, "
                                              f"stride {mod.stride}: only row-preserving ones are supported")
                if mod._padding[2]:
                    self._convs.append(mod)
            elif isinstance(mod, torch.nn.Conv2d):
                if mod.stride[0] != 1 or mod.padding[0] != (mod.kernel_size[0] - 1) // 2 or (
                        mod.padding[0] and type(mod) is not torch.nn.Conv2d):
                    raise NotImplementedError(f"diffcp.vae: a {cls} with kernel {mod.kernel_size}, stride "
                                              f"{mod.stride}, padding {mod.padding} in the decoder")
                if mod.padding[0]:
                    self._convs.append(mod)
            elif cls == "WanAttentionBlock":
                self._attn.append(mod)
            elif cls not in _LOCAL and not isinstance(mod, torch.nn.Conv2d):
                raise NotImplementedError(f"diffcp.vae: the decoder holds a {cls}, which this patch-parallel "
                                          "decode does not know to be row-local")
        # Modules inside an attention block (its 1 x 1 convs) run on gathered rows: not patched.
        inside = {id(m) for a in self._attn for m in a.modules()}
        self._convs = [m for m in self._convs if id(m) not in inside]
        self._check_unhooked()
        self.comm = comm.Dup()  # collective (after the checks, which fail alike everywhere): traffic of its own

    def _check_unhooked(self) -> None:
        """The patched modules' forward must be their class's: diffusers' hooks and accelerate's
        (offloading, layerwise casting) replace it on the instance, and would be bypassed."""
        for mod in self._convs + self._attn:
            if "forward" in mod.__dict__ or hasattr(mod, "_hf_hook") or hasattr(mod, "_diffusers_hook"):
                raise NotImplementedError(f"diffcp.vae: the decoder's {type(mod).__name__} carries a hook (CPU offload, "
                                          "layerwise casting, ...): the patch-parallel decode runs the VAE as it is, "
                                          "on the CPU; remove the hooks")

    # ---- the exchanges (every rank calls each in the same order: the decoder's module order) ----
    def _halo(self, x, r: int, dim: int):
        """x's r rows next to each neighbour -> (the r rows above x, the r rows below), zeros at the edges."""
        import torch
        from mpi4py import MPI
        up = self.p - 1 if self.p > 0 else MPI.PROC_NULL
        down = self.p + 1 if self.p < self.P - 1 else MPI.PROC_NULL
        n = x.shape[dim]
        mine_top, mine_bot = x.narrow(dim, 0, r).contiguous(), x.narrow(dim, n - r, r).contiguous()
        above, below = torch.zeros_like(mine_top), torch.zeros_like(mine_bot)
        self.comm.Sendrecv(_np(mine_top), dest=up, sendtag=1, recvbuf=_np(below), source=down, recvtag=1)
        self.comm.Sendrecv(_np(mine_bot), dest=down, sendtag=2, recvbuf=_np(above), source=up, recvtag=2)
        self.stats["halo"] += _nbytes(mine_top) * (up != MPI.PROC_NULL) + _nbytes(mine_bot) * (down != MPI.PROC_NULL)
        return above, below

    def _gather_rows(self, x, dim: int, key: str):
        """Every rank's rows of x (split as the latent's, times the level's scale) -> the whole tensor."""
        import torch
        scale = x.shape[dim] // self._rows[self.p]
        counts = [scale * r for r in self._rows]
        moved = x.movedim(dim, 0).contiguous()
        per_row = moved[0].numel()
        full = torch.empty((sum(counts),) + tuple(moved.shape[1:]), dtype=x.dtype)
        self.comm.Allgatherv(_np(moved), [_np(full), [c * per_row for c in counts]])
        self.stats[key] += (self.P - 1) * _nbytes(moved)
        return full.movedim(0, dim)

    # ---- the patched forwards ----
    def _causal_conv(self, mod, x, cache_x=None):
        import torch
        import torch.nn.functional as F
        pw, _, ph, _, pt, _ = mod._padding
        above, below = self._halo(x, ph, 3)
        hist = self._history.get(id(mod))
        pad = [pw, pw, 0, 0, pt, 0]
        if cache_x is not None and pt > 0:  # diffusers' cache: the last frames of this conv's input
            k = cache_x.shape[2]
            if hist is None or hist[0].shape[2] < k:
                raise RuntimeError(f"diffcp.vae: a causal convolution got {k} cached frame(s) but has seen "
                                   f"{0 if hist is None else hist[0].shape[2]}: diffusers' cache protocol changed")
            x = torch.cat([cache_x.to(x.device), x], 2)
            above = torch.cat([hist[0][:, :, -k:], above], 2)
            below = torch.cat([hist[1][:, :, -k:], below], 2)
            pad[4] -= k
            new = (above, below)
        else:
            new = (above, below) if hist is None else (torch.cat([hist[0], above], 2), torch.cat([hist[1], below], 2))
        if pt > 0:
            self._history[id(mod)] = (new[0][:, :, -_CACHE_T:], new[1][:, :, -_CACHE_T:])
        x = F.pad(torch.cat([above, x, below], 3), pad)
        return torch.nn.Conv3d.forward(mod, x)  # mod.padding is (0, 0, 0): WanCausalConv3d pads itself

    def _conv2d(self, mod, x):
        import torch
        import torch.nn.functional as F
        above, below = self._halo(x, mod.padding[0], 2)
        x = torch.cat([above, x, below], 2)
        return F.conv2d(x, mod.weight, mod.bias, mod.stride, (0, mod.padding[1]), mod.dilation, mod.groups)

    def _attention(self, mod, original, x):
        full = self._gather_rows(x, 3, "attention")
        scale = x.shape[3] // self._rows[self.p]
        start = scale * sum(self._rows[:self.p])
        return original(full).narrow(3, start, x.shape[3]).contiguous()

    def decode(self, z, return_dict: bool = True):
        """z [B, z_dim, T, h, w] (the same on every rank) -> the video [B, 3, 1 + 4 (T - 1), 8 h, 8 w] on
        every rank, as AutoencoderKLWan.decode returns it (DecoderOutput, or a tuple)."""
        import functools
        import torch
        vae = self.vae
        if z.dim() != 5:
            raise ValueError(f"diffcp.vae: z of shape {tuple(z.shape)}, expected [B, z_dim, T, h, w]")
        if z.shape[3] < self.P:
            raise ValueError(f"diffcp.vae: a latent of {z.shape[3]} rows cannot split over {self.P} ranks (one row "
                             "each at least)")
        if getattr(vae, "use_tiling", False):
            raise NotImplementedError("diffcp.vae: tiling and the patch-parallel decode do not combine: "
                                      "vae.disable_tiling() (the decode's memory already falls with P)")
        if z.device.type != "cpu" or any(p.device.type != "cpu" for p in vae.decoder.parameters()):
            raise NotImplementedError("diffcp.vae: the patch-parallel decode runs on the CPU (the latent and the "
                                      "VAE's weights in host memory)")
        self._check_unhooked()
        self._rows = row_split(int(z.shape[3]), self.P)
        start = sum(self._rows[:self.p])
        z_p = z.narrow(3, start, self._rows[self.p]).contiguous()
        self.stats = {"halo": 0, "attention": 0, "output": 0}
        self._history = {}
        patched = []
        try:
            for mod in self._convs:
                mod.forward = functools.partial(self._causal_conv if type(mod).__name__ == "WanCausalConv3d"
                                                else self._conv2d, mod)
                patched.append(mod)
            for mod in self._attn:
                mod.forward = functools.partial(self._attention, mod, type(mod).forward.__get__(mod))
                patched.append(mod)
            with torch.no_grad():
                out_p = vae._decode(z_p, return_dict=False)[0]
                out = self._gather_rows(out_p, 3, "output")
        except Exception as e:  # mid-collective: the other ranks would wait for this one
            sys.stderr.write(f"diffcp.vae: rank {self.p}: {type(e).__name__}: {e}\n")
            sys.stderr.flush()
            self.comm.Abort(1)
            raise
        finally:
            for mod in patched:
                del mod.forward  # the class's forward again
            self._history = {}
        if not return_dict:
            return (out,)
        from diffusers.models.autoencoders.vae import DecoderOutput
        return DecoderOutput(sample=out)
