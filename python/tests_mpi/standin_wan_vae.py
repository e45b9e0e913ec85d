"""A test double of diffusers' AutoencoderKLWan decoder (the Wan 2.1 VAE, and with is_residual the Wan 2.2
VAE's decoder) where diffusers is not installed
(CI has Debian's torch 1.13, not PyPI's diffusers): the decoder's module classes by name and the
contract diffcp.vae relies on, written from their behaviour, with random weights. It decodes what
the real class decodes only in structure, not in values (its own init); tools/diffusers_pipeline_check.py
runs diffcp.vae against diffusers' own class.

  WanCausalConv3d  an nn.Conv3d that pads itself: `_padding` (w, w, h, h, 2 t, 0), `padding` (0, 0, 0);
                   forward(x, cache_x) puts the cached frames where as many of the causal zero frames were
  the decode       one latent frame per decoder call; each causal convolution with a time kernel > 1 is
                   handed the last (at most two) frames of its earlier inputs (none at the first call)
  upsample3d       the first call's frame stays one ("Rep"); later calls: a (3, 1, 1) causal time
                   convolution doubles the channels into two frames; then, as upsample2d, a nearest
                   2x and a 3 x 3 Conv2d (padding 1) halving the channels
  mid block        residual block, single-head attention over each frame's pixels, residual block
  norms            RMS over channels (WanRMS_norm), SiLU
  is_residual      (Wan 2.2) WanResidualUpBlock: its input's channels not halved, the upsampler's Conv2d
                   keeping them, and a DupUp3D shortcut of the block's input (channels repeated into
                   the 2 x 2 pixels, and 2 frames for a temporal upsample but the first chunk's one)
                   added to its output; patch_size: the decoded channels unpatchified into p x p pixels
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

CACHE_T = 2


def _rand_(module: nn.Module, scale: float) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(scale * torch.randn_like(p))


class WanCausalConv3d(nn.Conv3d):
    def __init__(self, c_in: int, c_out: int, kernel, padding=0):
        super().__init__(c_in, c_out, kernel, padding=padding)
        pt, ph, pw = self.padding
        self._padding = (pw, pw, ph, ph, 2 * pt, 0)
        self.padding = (0, 0, 0)

    def forward(self, x, cache_x=None):
        pad = list(self._padding)
        if cache_x is not None and pad[4] > 0:
            x = torch.cat([cache_x, x], 2)
            pad[4] -= cache_x.shape[2]
        return super().forward(F.pad(x, pad))


def _cached(conv, x, cache: list, idx: list):
    """conv(x) under the decode's cache protocol: handed its cache, which becomes x's last frames."""
    i = idx[0]
    keep = x[:, :, -CACHE_T:].clone()
    if keep.shape[2] < CACHE_T and cache[i] is not None:
        keep = torch.cat([cache[i][:, :, -1:], keep], 2)
    out = conv(x, cache[i])
    cache[i], idx[0] = keep, i + 1
    return out


class WanRMS_norm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.normalize(x, dim=1) * x.shape[1] ** 0.5 * self.gamma.view(-1, *([1] * (x.dim() - 2)))


class WanResidualBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.norm1, self.conv1 = WanRMS_norm(c_in), WanCausalConv3d(c_in, c_out, 3, padding=1)
        self.norm2, self.conv2 = WanRMS_norm(c_out), WanCausalConv3d(c_out, c_out, 3, padding=1)
        self.conv_shortcut = WanCausalConv3d(c_in, c_out, 1) if c_in != c_out else nn.Identity()
        self.nonlinearity = nn.SiLU()

    def forward(self, x, cache, idx):
        h = self.conv_shortcut(x)
        x = _cached(self.conv1, self.nonlinearity(self.norm1(x)), cache, idx)
        return _cached(self.conv2, self.nonlinearity(self.norm2(x)), cache, idx) + h


class WanAttentionBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm, self.to_qkv, self.proj = WanRMS_norm(dim), nn.Conv2d(dim, 3 * dim, 1), nn.Conv2d(dim, dim, 1)

    def forward(self, x):
        b, c, t, h, w = x.shape
        y = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        q, k, v = self.to_qkv(self.norm(y)).reshape(b * t, 3, c, h * w).unbind(1)  # [(b t), c, h w] each
        a = torch.softmax(q.transpose(1, 2) @ k / c ** 0.5, -1)  # [(b t), h w, h w]
        y = self.proj((v @ a.transpose(1, 2)).reshape(b * t, c, h, w))
        return x + y.reshape(b, t, c, h, w).permute(0, 2, 1, 3, 4)


class WanMidBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.resnets = nn.ModuleList([WanResidualBlock(dim, dim), WanResidualBlock(dim, dim)])
        self.attentions = nn.ModuleList([WanAttentionBlock(dim)])

    def forward(self, x, cache, idx):
        x = self.resnets[0](x, cache, idx)
        return self.resnets[1](self.attentions[0](x), cache, idx)


class WanUpsample(nn.Upsample):
    pass


class WanResample(nn.Module):
    def __init__(self, dim: int, mode: str, out_dim: int | None = None):
        super().__init__()
        self.mode = mode
        self.resample = nn.Sequential(WanUpsample(scale_factor=2.0, mode="nearest"),
                                      nn.Conv2d(dim, out_dim or dim // 2, 3, padding=1))
        if mode == "upsample3d":
            self.time_conv = WanCausalConv3d(dim, 2 * dim, (3, 1, 1), padding=(1, 0, 0))

    def forward(self, x, cache, idx):
        b, c, t, h, w = x.shape
        if self.mode == "upsample3d":
            i = idx[0]
            if cache[i] is None:  # the first call: its frame stays one
                cache[i] = "Rep"
            else:
                keep = x[:, :, -CACHE_T:].clone()
                if keep.shape[2] < CACHE_T:
                    prev = torch.zeros_like(keep) if isinstance(cache[i], str) else cache[i][:, :, -1:]
                    keep = torch.cat([prev, keep], 2)
                x = self.time_conv(x, None if isinstance(cache[i], str) else cache[i])
                cache[i] = keep
                x = x.reshape(b, 2, c, t, h, w).permute(0, 2, 3, 1, 4, 5).reshape(b, c, 2 * t, h, w)
            idx[0] = i + 1
        t = x.shape[2]
        y = self.resample(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))
        return y.reshape(b, t, *y.shape[1:]).permute(0, 2, 1, 3, 4)


class WanUpBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, num_res_blocks: int, mode):
        super().__init__()
        self.resnets = nn.ModuleList([WanResidualBlock(c_in if j == 0 else c_out, c_out) for j in range(num_res_blocks + 1)])
        self.upsamplers = nn.ModuleList([WanResample(c_out, mode)]) if mode else None

    def forward(self, x, cache, idx):
        for r in self.resnets:
            x = r(x, cache, idx)
        return self.upsamplers[0](x, cache, idx) if self.upsamplers is not None else x


class DupUp3D(nn.Module):
    """Wan 2.2's shortcut: channels repeated, then spread over factor_t frames and 2 x 2 pixels."""

    def __init__(self, c_in: int, c_out: int, factor_t: int):
        super().__init__()
        self.c_out, self.ft = c_out, factor_t
        self.repeats = c_out * factor_t * 4 // c_in

    def forward(self, x, first_chunk=False):
        b, _, t, h, w = x.shape
        x = x.repeat_interleave(self.repeats, 1).reshape(b, self.c_out, self.ft, 2, 2, t, h, w)
        x = x.permute(0, 1, 5, 2, 6, 3, 7, 4).reshape(b, self.c_out, t * self.ft, 2 * h, 2 * w)
        return x[:, :, self.ft - 1:] if first_chunk else x


class WanResidualUpBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, num_res_blocks: int, mode):
        super().__init__()
        self.resnets = nn.ModuleList([WanResidualBlock(c_in if j == 0 else c_out, c_out) for j in range(num_res_blocks + 1)])
        self.upsampler = WanResample(c_out, mode, c_out) if mode else None
        self.avg_shortcut = DupUp3D(c_in, c_out, 2 if mode == "upsample3d" else 1) if mode else None

    def forward(self, x, cache, idx, first_chunk=False):
        x0 = x
        for r in self.resnets:
            x = r(x, cache, idx)
        if self.upsampler is not None:
            x = self.upsampler(x, cache, idx)
        return x + self.avg_shortcut(x0, first_chunk) if self.avg_shortcut is not None else x


class WanDecoder3d(nn.Module):
    def __init__(self, c):
        super().__init__()
        mult = c.dim_mult
        dims = [c.base_dim * u for u in [mult[-1]] + mult[::-1]]
        up_time = c.temperal_downsample[::-1]
        self.conv_in = WanCausalConv3d(c.z_dim, dims[0], 3, padding=1)
        self.mid_block = WanMidBlock(dims[0])
        self.up_blocks = nn.ModuleList()
        for i in range(len(mult)):
            mode = None if i == len(mult) - 1 else ("upsample3d" if up_time[i] else "upsample2d")
            if c.is_residual:
                self.up_blocks.append(WanResidualUpBlock(dims[i], dims[i + 1], c.num_res_blocks, mode))
            else:
                self.up_blocks.append(WanUpBlock(dims[i] // 2 if i > 0 else dims[i], dims[i + 1], c.num_res_blocks, mode))
        self.norm_out, self.nonlinearity = WanRMS_norm(dims[-1]), nn.SiLU()
        self.conv_out = WanCausalConv3d(dims[-1], c.out_channels, 3, padding=1)
        self.residual = c.is_residual

    def forward(self, x, cache, idx, first_chunk=False):
        x = self.mid_block(_cached(self.conv_in, x, cache, idx), cache, idx)
        for up in self.up_blocks:
            x = up(x, cache, idx, first_chunk) if self.residual else up(x, cache, idx)
        return _cached(self.conv_out, self.nonlinearity(self.norm_out(x)), cache, idx)


class AutoencoderKLWan(nn.Module):
    """The decode half of the class, random: `config`, `decoder`, `use_tiling`, `_decode` / `decode`."""

    def __init__(self, seed: int = 0, base_dim: int = 8, z_dim: int = 4, dim_mult=(1, 2, 2, 2), num_res_blocks: int = 1,
                 temperal_downsample=(False, True, True), is_residual: bool = False, patch_size: int | None = None):
        super().__init__()
        p = patch_size or 1
        self.config = SimpleNamespace(base_dim=base_dim, decoder_base_dim=None, z_dim=z_dim, dim_mult=list(dim_mult),
                                      num_res_blocks=num_res_blocks, temperal_downsample=list(temperal_downsample),
                                      out_channels=3 * p * p, is_residual=is_residual, patch_size=patch_size)
        torch.manual_seed(seed)
        self.post_quant_conv = WanCausalConv3d(z_dim, z_dim, 1)
        self.decoder = WanDecoder3d(self.config)
        _rand_(self, 0.2)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, WanRMS_norm):
                    m.gamma.fill_(1.0)
            self.decoder.conv_out.weight.mul_(0.2)  # most of the video inside the clamp's [-1, 1]
        self.use_tiling = False

    def _decode(self, z, return_dict: bool = True):
        x = self.post_quant_conv(z)
        cache = [None] * sum(isinstance(m, (WanCausalConv3d, WanResample)) for m in self.decoder.modules())
        frames = []
        for i in range(z.shape[2]):
            frames.append(self.decoder(x[:, :, i:i + 1], cache, [0], first_chunk=i == 0))
        out = torch.cat(frames, 2)
        p = self.config.patch_size
        if p:  # [b, 3 p p, t, h, w] -> [b, 3, t, p h, p w], channels (c, p_row, p_col)
            b, c, t, h, w = out.shape
            out = out.reshape(b, c // (p * p), p, p, t, h, w).permute(0, 1, 4, 5, 3, 6, 2).reshape(b, c // (p * p), t, h * p, w * p)
        return (torch.clamp(out, -1.0, 1.0),)

    def decode(self, z, return_dict: bool = True):
        return self._decode(z, return_dict)
