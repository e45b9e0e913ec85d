"""diffcp: communication-efficient parallel attention for diffusion models.

The Python face of the C++ library (see docs/python.md):

* :func:`plan` — load-balance one packed DFlash micro-batch over ``P`` context-parallel ranks
  (SPEC A.3): what a PyTorch trainer calls every step to lay out its context.
* :mod:`diffcp.attention` — the block-sparse DFlash attention kernels (forward / backward) on
  numpy arrays or CPU torch tensors, float32 or bf16, zero-copy; :mod:`diffcp.torch` (where
  torch is installed) — the same as a ``torch.autograd.Function``.
* :func:`backends` — the compute backends of this build; ``backend=`` on :class:`SplitKV`,
  :meth:`Drafter.load` and ``diffusers.parallelize`` chooses one (host-memory backends only: the
  bindings hand numpy memory to the ops).
* :func:`to_bf16`, :func:`from_bf16` — float32 <-> bf16 bits (uint16; numpy has no bfloat16).
* :class:`SplitKV` — one Split-KV attention layer over an mpi4py communicator.
* :class:`Drafter` — a DFlash drafter loaded from a DFlash-format folder, drafting one block;
  :mod:`diffcp.speculative` — ``generate(target, drafter, input_ids, max_new_tokens)``,
  speculative decoding with a transformers target (greedy, or sampled: lossless in distribution)
  from a draft KV cache, measuring tau and time.
* :mod:`diffcp.diffusers` — ``parallelize(pipe)``: a diffusers pipeline (FLUX.1, SD3.5,
  Qwen-Image, FLUX.2) whose transformer runs sequence-parallel on diffcp (import it explicitly;
  it needs torch, and diffusers for the pipelines).

Shapes use the names of docs/design.md (Part A): ``b`` samples, ``S`` packed context rows,
``B`` block size, ``N`` blocks, ``Q = N * B`` query rows, ``P`` ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from . import _core
from . import attention
from . import speculative
from .drafter import Drafter
from .splitkv import LayerConfig, SplitKV

__all__ = ["Plan", "plan", "balancer_names", "attention", "SplitKV", "LayerConfig", "run_layer", "Drafter", "speculative",
           "to_bf16", "from_bf16", "bf16_path", "cpu_kernels", "backends"]


@dataclass(frozen=True)
class Plan:
    """A chunk -> rank assignment of the packed context and the loads it gives.

    Attributes:
        balancer: the balancer that made it.
        P, J: ranks and chunks per rank.
        chunks: int64 ``[n_chunks, 2]`` — ``[begin, end)`` packed positions, in packed order,
            covering ``[0, S)`` once.
        rank: int32 ``[n_chunks]`` — the rank each chunk goes to.
        context_work, block_work, rank_work: int64 ``[P]`` — ``C_p``, ``D_p``, ``W_p = C_p + D_p``
            (attention pairs per head, SPEC A.3).
        rho: ``max_p W_p / mean_p W_p``; imbalance_pct: ``100 * (rho - 1)``.
    """

    balancer: str
    P: int
    J: int
    chunks: np.ndarray
    rank: np.ndarray
    context_work: np.ndarray
    block_work: np.ndarray
    rank_work: np.ndarray
    rho: float
    imbalance_pct: float

    def chunks_of_rank(self, p: int) -> np.ndarray:
        """int64 ``[k, 2]``: the ``[begin, end)`` ranges rank ``p`` holds, in packed order."""
        if not 0 <= p < self.P:
            raise ValueError(f"p = {p}: expected 0 <= p < P = {self.P}")
        return self.chunks[self.rank == p]


def _int_array(x, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype.kind not in "iu" and not (a.size == 0 and a.dtype.kind == "f"):
        raise TypeError(f"{name}: expected integers, got dtype {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array, got shape {list(a.shape)}")
    return a.astype(np.int64, copy=False)


def _batch_args(lengths, anchors, block: int):
    lengths = _int_array(lengths, "lengths")
    if isinstance(anchors, np.ndarray) and anchors.dtype != object:
        raise TypeError("anchors: expected a sequence with one 1-D integer array per sample")
    anchors = [_int_array(a, f"anchors[{u}]") for u, a in enumerate(anchors)]
    if int(block) != block:
        raise TypeError(f"block: expected an integer, got {block!r}")
    return lengths, anchors, int(block)


def plan(lengths: Sequence[int] | np.ndarray, anchors: Sequence[Sequence[int] | np.ndarray], block: int,
         P: int, J: int = 16, balancer: str = "lpt", windows: Sequence[int] | None = None) -> Plan:
    """Load-balance a packed micro-batch over ``P`` ranks.

    Args:
        lengths: ``[b]`` sample lengths (tokens); samples are packed back to back into ``S`` rows.
        anchors: ``b`` arrays, ``anchors[u]``: ``[A_u]`` sorted anchor positions *inside* sample
            ``u`` (0-based; ``a + block <= lengths[u]``).
        block: ``B``, query rows per anchor block.
        P: ranks of the context-parallel group.
        J: chunks per rank (lpt, partition); ``P * J <= S``.
        balancer: ``"lpt"`` (default), ``"zigzag"``, ``"none"`` or ``"partition"`` (METIS).
        windows: the drafter's layers, one entry each: its sliding window (causal, as z-lab's
            ``sliding_attention`` layers), 0 for a full layer; the loads sum the layers, a sliding
            layer counting only the rows whose windows reach a context row. ``None``: one full
            layer (SPEC A.3).

    Returns:
        a :class:`Plan`. Deterministic: every rank that calls it gets the same plan.

    Raises:
        TypeError / ValueError naming the bad value (non-integer input, an anchor out of its
        sample, ``P * J > S``, an unknown balancer, ...).
    """
    lengths, anchors, block = _batch_args(lengths, anchors, block)
    d = _core.plan(lengths, anchors, block, int(P), int(J), str(balancer), [int(w) for w in (windows or [])])
    return Plan(**d)


def balancer_names() -> list[str]:
    """The balancers :func:`plan` accepts."""
    return list(_core.balancer_names())


def to_bf16(x) -> np.ndarray:
    """float32 array -> uint16 ``[same shape]`` holding bf16 bits (round to nearest even, as torch)."""
    return _core.to_bf16(np.asarray(x, np.float32))


def from_bf16(x: np.ndarray) -> np.ndarray:
    """uint16 array of bf16 bits -> float32 ``[same shape]`` (exact)."""
    x = np.asarray(x)
    if x.dtype != np.uint16:
        raise TypeError(f"from_bf16: expected uint16 bf16 bits, got dtype {x.dtype}")
    return _core.from_bf16(np.ascontiguousarray(x))


def bf16_path() -> str:
    """Which kernel runs bf16 here (e.g. oneDNN's bf16 matmul with native instructions, or the f32
    conversion path on CPUs where oneDNN has none)."""
    return _core.bf16_path()


def cpu_kernels() -> str:
    """Which CPU kernels run (the package is portable: its kernels are compiled for AVX-512, AVX2
    and the x86-64 baseline and the widest this CPU has is chosen; DIFFCP_CPU_ISA=avx2 chooses)."""
    return _core.cpu_kernels()


def backends() -> list[dict]:
    """The compute backends this build registers: ``[{"name", "device", "f32", "bf16"}]`` (what
    runs each dtype there). The CLI's ``diffcp backends`` lists the same (and its guard device)."""
    return [dict(b) for b in _core.backends()]


def _comm_kind(comm, default=None):
    """(mpi4py communicator, transport) from a ``comm=`` argument: an mpi4py communicator (over MPI),
    ``"mpi"`` or ``"rendezvous"`` (``MPI.COMM_WORLD``; rendezvous: NCCL's semantics made strict on MPI,
    docs/gpu.md), or None for ``default`` (an mpi4py communicator)."""
    if comm is None:
        comm = default
    if isinstance(comm, str):
        if comm not in ("mpi", "rendezvous"):
            raise ValueError(f"comm: '{comm}': expected an mpi4py communicator, 'mpi' or 'rendezvous'")
        from mpi4py import MPI  # Debian's python3-mpi4py; initialises MPI
        return MPI.COMM_WORLD, comm
    if not hasattr(comm, "py2f") or not hasattr(comm, "Get_size"):
        raise TypeError(f"comm: expected an mpi4py communicator, 'mpi' or 'rendezvous', got {type(comm).__name__}")
    return comm, "mpi"


def run_layer(comm, config: LayerConfig, method: str = "splitkv", layout: str = "none", samples: int = 2,
              context: int = 1024, queries: int = 256, block: int = 16, prompt_fraction: float = 0.25,
              window: int = 0, dtype: str = "f32", seed: int = 1, warmup: int = 1, reps: int = 3, J: int = 16,
              check: bool = False) -> dict:
    """One CP method's measured drafter-attention layer step over an mpi4py communicator: the
    library routine ``diffcp attn`` runs (C++ ``testing/layer_run.hpp``; nothing re-derived here).
    A seeded packed batch of ``samples`` samples (``context`` tokens, ``queries`` query rows in
    blocks of ``block``), the context laid out by the balancer ``layout``, ``warmup`` untimed and
    ``reps`` timed forward + backward steps. Returns the medians of the slowest rank
    (``step_ms``, ``fwd_ms``, ``bwd_ms``, ``exposed_comm_ms``), the bytes one layer sent per rank
    against the method's closed form (``bytes_per_layer``, ``predicted_bytes_per_layer``), and with
    ``check`` the comparison with the fp64 reference (``check_passed``, ``max_rel_err``, ...).
    Collective: every rank calls it with the same arguments."""
    comm, kind = _comm_kind(comm)
    return dict(_core.run_layer(comm.py2f(), config, str(method), str(layout), int(samples), int(context),
                                int(queries), int(block), float(prompt_fraction), int(window), str(dtype), int(seed),
                                int(warmup), int(reps), int(J), bool(check), kind))
