"""Block-sparse DFlash attention (SPEC A.1) on numpy arrays or CPU torch tensors, f32 or bf16.

The mask is built from ``(lengths, anchors, block)`` as in :func:`diffcp.plan`. Layout of one
single-process call (SPEC's): key rows ``[0, S)`` are the packed context, rows
``[S + i*B, S + (i+1)*B)`` are block ``i``'s own rows, so ``L_k = S + Q``. Query block ``i`` sees
its sample's context strictly before its anchor and its own ``B`` rows (bidirectional).
GQA: query head ``j`` uses kv head ``j // (n_q // n_kv)``.

Storage types (all of ``q, k, v, o, do`` alike; ``lse`` is always float32):

* float32 — numpy ``float32`` or ``torch.float32``; fp32 accumulation.
* bf16 — ``torch.bfloat16``, or for numpy (which has no bfloat16) the bf16 bits as ``uint16``
  (:func:`diffcp.to_bf16` / :func:`diffcp.from_bf16` convert); fp32 accumulation and softmax,
  as FlashAttention runs bf16.

Inputs must be C-contiguous and are used in place (no copies; torch tensors through their numpy
view of the same memory); outputs are new arrays of the inputs' kind. Anything else is an error.
For autograd, see :mod:`diffcp.torch`.
"""
from __future__ import annotations

import numpy as np

from . import _core

__all__ = ["forward", "backward"]


def _is_torch(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _view(x, name: str) -> np.ndarray:
    """The numpy view (same memory) of a numpy array or a CPU torch tensor; bf16 as uint16 bits."""
    if _is_torch(x):
        import torch
        if x.device.type != "cpu":
            raise ValueError(f"{name}: tensor on {x.device}; diffcp's CPU backend takes CPU tensors")
        x = x.detach()
        if x.dtype == torch.float32:
            return x.numpy()
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(np.uint16)
        raise TypeError(f"{name}: expected torch.float32 or torch.bfloat16, got {x.dtype}")
    if isinstance(x, np.ndarray):
        if x.dtype.name == "bfloat16":  # ml_dtypes' bfloat16, where installed
            return x.view(np.uint16)
        return x
    raise TypeError(f"{name}: expected a numpy array or a torch tensor, got {type(x).__name__}")


def _kind(arrays: dict) -> bool:
    """Whether the named inputs are all torch tensors (True) or all numpy arrays (False)."""
    kinds = {name: _is_torch(x) for name, x in arrays.items()}
    if len(set(kinds.values())) > 1:
        raise TypeError("mixed numpy arrays and torch tensors: " +
                        ", ".join(f"{n} is {'torch' if t else 'numpy'}" for n, t in kinds.items()))
    return next(iter(kinds.values()))


def _empty(shape, like: np.ndarray, torch_out: bool, f32: bool = False):
    """A new output (numpy array or torch tensor) of `like`'s storage type (or float32) and its view."""
    if torch_out:
        import torch
        t = torch.empty(tuple(shape), dtype=torch.float32 if f32 or like.dtype == np.float32 else torch.bfloat16)
        return t, _view(t, "out")
    a = np.empty(shape, np.float32 if f32 else like.dtype)
    return a, a


def forward(q, k, v, lengths, anchors, block: int, softmax_scale: float = 0.0):
    """Attention forward.

    Args:
        q: ``[Q, n_q, d_h]``; k, v: ``[S + Q, n_kv, d_h]`` — float32 or bf16 (see module doc).
        lengths, anchors, block: the batch (see :func:`diffcp.plan`).
        softmax_scale: ``<= 0`` means ``1 / sqrt(d_h)``.

    Returns:
        ``(o, lse)``: ``[Q, n_q, d_h]`` in q's storage type and float32 ``[Q, n_q]`` (natural-log
        log-sum-exp of the scaled scores per row and head), numpy or torch like the inputs.
    """
    from . import _batch_args
    lengths, anchors, block = _batch_args(lengths, anchors, block)
    torch_io = _kind({"q": q, "k": k, "v": v})
    qa, ka, va = _view(q, "q"), _view(k, "k"), _view(v, "v")
    if qa.ndim != 3:
        raise ValueError("q: expected a 3-D array [Q, n_q, d_h]")
    o, oa = _empty(qa.shape, qa, torch_io)
    lse, la = _empty(qa.shape[:2], qa, torch_io, f32=True)
    _core.attention_forward(qa, ka, va, oa, la, lengths, anchors, block, float(softmax_scale))
    return o, lse


def backward(q, k, v, o, lse, do, lengths, anchors, block: int, softmax_scale: float = 0.0):
    """Attention backward from the forward's ``o`` and ``lse``.

    Args:
        q, k, v, lengths, anchors, block, softmax_scale: as in :func:`forward`.
        o, lse: :func:`forward`'s outputs, ``[Q, n_q, d_h]`` and float32 ``[Q, n_q]``.
        do: ``[Q, n_q, d_h]``, the gradient of the loss with respect to ``o`` (q's storage type).

    Returns:
        ``(dq, dk, dv)``: ``[Q, n_q, d_h]``, ``[S + Q, n_kv, d_h]``, ``[S + Q, n_kv, d_h]`` in q's
        storage type, numpy or torch like the inputs.
    """
    from . import _batch_args
    lengths, anchors, block = _batch_args(lengths, anchors, block)
    torch_io = _kind({"q": q, "k": k, "v": v, "o": o, "lse": lse, "do": do})
    qa, ka, va = _view(q, "q"), _view(k, "k"), _view(v, "v")
    oa, la, ga = _view(o, "o"), _view(lse, "lse"), _view(do, "do")
    if qa.ndim != 3 or ka.ndim != 3:
        raise ValueError("q, k: expected 3-D arrays [rows, heads, d_h]")
    dq, dqa = _empty(qa.shape, qa, torch_io)
    dk, dka = _empty(ka.shape, qa, torch_io)
    dv, dva = _empty(ka.shape, qa, torch_io)
    _core.attention_backward(qa, ka, va, oa, la, ga, dqa, dka, dva, lengths, anchors, block, float(softmax_scale))
    return dq, dk, dv
