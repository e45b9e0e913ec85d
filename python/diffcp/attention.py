"""Block-sparse DFlash attention (SPEC A.1) on numpy arrays.

The mask is built from ``(lengths, anchors, block)`` as in :func:`diffcp.plan`. Layout of one
single-process call (SPEC's): key rows ``[0, S)`` are the packed context, rows
``[S + i*B, S + (i+1)*B)`` are block ``i``'s own rows, so ``L_k = S + Q``. Query block ``i`` sees
its sample's context strictly before its anchor and its own ``B`` rows (bidirectional).

Arrays are float32 and C-contiguous, used in place (no copies); anything else is an error.
fp32 storage, fp32 accumulation. GQA: query head ``j`` uses kv head ``j // (n_q // n_kv)``.
"""
from __future__ import annotations

import numpy as np

from . import _core

__all__ = ["forward", "backward"]


def forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, lengths, anchors, block: int,
            softmax_scale: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Attention forward.

    Args:
        q: float32 ``[Q, n_q, d_h]``.
        k, v: float32 ``[S + Q, n_kv, d_h]``.
        lengths, anchors, block: the batch (see :func:`diffcp.plan`).
        softmax_scale: ``<= 0`` means ``1 / sqrt(d_h)``.

    Returns:
        ``(o, lse)``: float32 ``[Q, n_q, d_h]`` and ``[Q, n_q]`` (natural-log log-sum-exp of the
        scaled scores per row and head).
    """
    from . import _batch_args
    lengths, anchors, block = _batch_args(lengths, anchors, block)
    return _core.attention_forward(q, k, v, lengths, anchors, block, float(softmax_scale))


def backward(q: np.ndarray, k: np.ndarray, v: np.ndarray, o: np.ndarray, lse: np.ndarray, do: np.ndarray,
             lengths, anchors, block: int, softmax_scale: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Attention backward from the forward's ``o`` and ``lse``.

    Args:
        q, k, v, lengths, anchors, block, softmax_scale: as in :func:`forward`.
        o, lse: :func:`forward`'s outputs, ``[Q, n_q, d_h]`` and ``[Q, n_q]``.
        do: float32 ``[Q, n_q, d_h]``, the gradient of the loss with respect to ``o``.

    Returns:
        ``(dq, dk, dv)``: float32 ``[Q, n_q, d_h]``, ``[S + Q, n_kv, d_h]``, ``[S + Q, n_kv, d_h]``.
    """
    from . import _batch_args
    lengths, anchors, block = _batch_args(lengths, anchors, block)
    return _core.attention_backward(q, k, v, o, lse, do, lengths, anchors, block, float(softmax_scale))
