"""Split-KV (SPEC A.2): one drafter cross-attention layer, context-parallel over an mpi4py
communicator. Every rank holds its context chunks' K/V rows and owns a contiguous range of the
anchor blocks; only query-sized tensors cross ranks.

Run under MPI, every rank calling the same methods in the same order (they are collective)::

    mpirun -np 4 python -m mpi4py train.py     # -m mpi4py: an exception on one rank aborts all

Legend: ``H`` hidden width, ``Q_p`` query rows this rank owns, ``C_p`` context rows it holds,
``n_params`` = :attr:`SplitKV.param_count`.
"""
from __future__ import annotations

import numpy as np

from . import _core
from ._core import LayerConfig

__all__ = ["SplitKV", "LayerConfig"]


class SplitKV:
    """One Split-KV attention layer.

    Args:
        comm: an ``mpi4py.MPI.Comm`` (duplicated inside; diffcp's traffic never matches yours), or
            ``"rendezvous"``: ``MPI.COMM_WORLD`` on NCCL's semantics made strict (docs/gpu.md).
        config: :class:`LayerConfig` ``(hidden, n_q, n_kv, d_h, rope_theta=1e6, rms_eps=1e-6)``.
        lengths, anchors, block: the packed micro-batch (as :func:`diffcp.plan`); the same on every rank.
        plan: a :class:`diffcp.Plan` for ``P = comm.Get_size()`` ranks (e.g. LPT), or ``None`` for
            contiguous slices.
        dtype: ``"f32"``, or ``"bf16"``: attention and projection GEMMs in bf16 with f32
            accumulation and the row collectives in bf16 (half the bytes); the arrays in and out,
            norms, RoPE, lse and D stay float32 (C++ ``SplitKVOptions::compute``).
        backend: the compute backend (:func:`diffcp.backends`; ``"cpu"``).
    """

    def __init__(self, comm, config: LayerConfig, lengths, anchors, block: int, plan=None, dtype: str = "f32",
                 backend: str = "cpu"):
        from . import _batch_args
        _core.check_backend(str(backend))
        from . import _comm_kind
        comm, kind = _comm_kind(comm)
        if plan is not None and plan.P != comm.Get_size():
            raise ValueError(f"plan: made for P = {plan.P}, the communicator has {comm.Get_size()} ranks")
        lengths, anchors, block = _batch_args(lengths, anchors, block)
        self._layer = _core.SplitKV(comm.py2f(), config, lengths, anchors, block,
                                    None if plan is None else plan.chunks, None if plan is None else plan.rank,
                                    str(dtype), kind)
        self.config = config

    @property
    def param_count(self) -> int:
        """Floats in the flat parameter (and gradient) vector."""
        return self._layer.param_count

    def param_layout(self) -> dict:
        """``{name: (offset, shape)}`` of wq ``[H, n_q*d_h]``, wk, wv ``[H, n_kv*d_h]``, wo ``[n_q*d_h, H]``,
        bo ``[H]``, q_norm, k_norm ``[d_h]`` in the flat vector (matrices stored ``[in, out]``)."""
        return {k: (o, tuple(s)) for k, (o, s) in self._layer.param_layout().items()}

    def init_params(self, seed: int) -> np.ndarray:
        """float32 ``[n_params]``, seeded (weights N(0, 1/in), bias N(0, 0.02^2), norms 1 + N(0, 0.1^2))."""
        return self._layer.init_params(int(seed))

    @property
    def owned_query_rows(self) -> tuple[int, int]:
        """``[begin, end)`` of the global query rows (of ``Q``) this rank owns: ``x``, ``y`` rows."""
        return tuple(self._layer.owned_query_rows)

    @property
    def context_chunks(self) -> np.ndarray:
        """int64 ``[k, 2]``: packed ``[begin, end)`` ranges this rank holds, in the order of its ``ctx`` rows."""
        return self._layer.context_chunks

    @property
    def predicted_bytes_per_layer(self) -> float:
        """Closed-form bytes one forward + backward sends per rank (mean over ranks)."""
        return self._layer.predicted_bytes_per_layer

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank's communicator has sent so far."""
        return self._layer.bytes_sent

    def forward(self, params: np.ndarray, x: np.ndarray, ctx: np.ndarray):
        """``y = attention(x | ctx)`` for the owned query rows.

        Args:
            params: float32 ``[n_params]``, the same on every rank.
            x: float32 ``[Q_p, H]`` hidden states of the owned blocks' rows.
            ctx: float32 ``[C_p, H]`` the held context rows (in :attr:`context_chunks` order).

        Returns:
            ``(y, saved)``: float32 ``[Q_p, H]`` and the context :meth:`backward` consumes (once).
        """
        return self._layer.forward(params, x, ctx)

    def backward(self, saved, params: np.ndarray, dy: np.ndarray):
        """Gradients from :meth:`forward`'s ``saved`` (consumed) and ``dy`` float32 ``[Q_p, H]``.

        Returns:
            ``(dx, dctx, grad)``: float32 ``[Q_p, H]``, ``[C_p, H]``, ``[n_params]`` — ``grad`` is this
            rank's share: the sum over ranks (``comm.Allreduce``) is the layer's gradient.
        """
        return self._layer.backward(saved, params, dy)
