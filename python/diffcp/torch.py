"""PyTorch autograd for diffcp's DFlash attention (CPU tensors, float32 or bfloat16).

:func:`dflash_attention` is the drop-in call a PyTorch DFlash trainer makes (like flash-attn's
``flash_attn_func`` or ring-flash-attention's ``ring_flash_attn_func``): it returns ``o`` and
differentiates into ``q, k, v`` through :class:`DFlashAttention`, whose forward and backward are
:func:`diffcp.attention.forward` / :func:`diffcp.attention.backward` on the tensors' memory
(no copies of the inputs). Shapes and layout: :mod:`diffcp.attention`.

Import it only where torch is installed (``import diffcp.torch``); ``import diffcp`` never needs
torch.
"""
from __future__ import annotations

import torch

from . import attention as _attention

__all__ = ["DFlashAttention", "dflash_attention"]


class DFlashAttention(torch.autograd.Function):
    """``o = softmax(scale * q k^T + mask) v`` on the DFlash block-sparse mask.

    forward(q ``[Q, n_q, d_h]``, k, v ``[S + Q, n_kv, d_h]``, lengths, anchors, block, softmax_scale)
    returns ``(o, lse)``; ``lse`` (float32 ``[Q, n_q]``) is not differentiable.
    """

    @staticmethod
    def forward(ctx, q, k, v, lengths, anchors, block, softmax_scale):
        q, k, v = (t.contiguous() for t in (q, k, v))
        o, lse = _attention.forward(q, k, v, lengths, anchors, block, softmax_scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.batch = (lengths, anchors, block, softmax_scale)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        lengths, anchors, block, softmax_scale = ctx.batch
        dq, dk, dv = _attention.backward(q, k, v, o, lse, do.contiguous().to(q.dtype), lengths, anchors, block,
                                         softmax_scale)
        return dq, dk, dv, None, None, None, None


def dflash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths, anchors, block: int,
                     softmax_scale: float = 0.0, return_lse: bool = False):
    """Differentiable DFlash attention; returns ``o`` (``[Q, n_q, d_h]``, q's dtype), and ``lse`` too
    when ``return_lse``. Arguments as in :func:`diffcp.attention.forward`."""
    o, lse = DFlashAttention.apply(q, k, v, lengths, anchors, block, softmax_scale)
    return (o, lse) if return_lse else o
