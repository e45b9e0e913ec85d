"""A DFlash drafter as it is served: loaded from a DFlash-format folder (``diffcp export``'s, or a
released z-lab drafter's ``config.json`` + ``model.safetensors``), drafting one block from the
target's hidden states (C++ ``draft_block``: the computation of ``diffcp draft``, Split-KV over
the context when the communicator has several ranks).

Legend: ``ctx`` context positions, ``n_t`` target layers the drafter fuses, ``H`` hidden width,
``B`` block size (``block_size``), ``b`` rows of one draft (``2 <= b <= B``).
"""
from __future__ import annotations

import numpy as np

from . import _core

__all__ = ["Drafter", "DraftCache"]


def _f32_rows(x) -> np.ndarray:
    """A C-contiguous float32 numpy array of ``x`` (numpy or a CPU torch tensor; copies if needed)."""
    if hasattr(x, "detach"):  # torch
        x = x.detach().to("cpu").float().numpy()
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32))


class Drafter:
    """A DFlash drafter (``DFlashDraftModel``'s math: full and sliding-window layers).

    Build it with :meth:`load`. Attributes from its ``config.json``: :attr:`block_size`,
    :attr:`mask_token_id`, :attr:`target_layer_ids`, :attr:`hidden_size`, :attr:`config` (a dict).
    """

    def __init__(self, core, comm):
        self._core = core
        self._comm = comm
        self.config = dict(core.config())
        self.block_size: int = self.config["block_size"]
        self.mask_token_id: int = self.config["mask_token_id"]
        self.target_layer_ids: list[int] = list(self.config["target_layer_ids"])
        self.hidden_size: int = self.config["hidden_size"]

    @classmethod
    def load(cls, path: str, comm=None, backend: str = "cpu") -> "Drafter":
        """Loads ``path/config.json`` + ``path/model.safetensors``.

        Args:
            comm: an ``mpi4py.MPI.Comm`` whose ranks draft together (Split-KV over the context;
                every rank calls :meth:`draft` with the same arrays), or ``None`` for this process
                alone (``COMM_SELF``).
            backend: the compute backend (:func:`diffcp.backends`; ``"cpu"``).

        Raises:
            ValueError naming what the folder lacks or what its config asks that is not supported.
        """
        _core.check_backend(str(backend))
        from mpi4py import MPI  # Debian's python3-mpi4py; initialises MPI
        from . import _comm_kind
        comm, kind = _comm_kind(comm, MPI.COMM_SELF)
        return cls(_core.Drafter(str(path), comm.py2f(), kind), comm)

    def draft(self, target_hidden, noise_embedding) -> np.ndarray:
        """One draft block.

        Args:
            target_hidden: ``[ctx, n_t * H]`` the target's hidden states of context positions
                ``0 .. ctx-1`` from its layers :attr:`target_layer_ids` (the output of layer ``l`` is
                ``hidden_states[l + 1]`` in transformers), concatenated in that order.
            noise_embedding: ``[b, H]`` the target's input embedding of the block at positions
                ``ctx .. ctx+b-1``: the last verified token, then ``b - 1`` mask tokens.

        Returns:
            float32 ``[b, H]``: the drafter's final RMSNorm output; the target's LM head turns rows
            ``1 .. b-1`` into the draft logits of positions ``ctx+1 .. ctx+b-1``.
        """
        return self._core.draft(_f32_rows(target_hidden), _f32_rows(noise_embedding))

    def propose(self, hidden, anchor_id: int, lm_head, temperature: float = 0.0, seed: int = 0):
        """DFlash2 (``config["architecture"] == "DFlash2DraftModel"``): the block's drafted tokens
        through the candidate selector, as z-lab's ``DFlash2DraftModel.propose`` (C++
        ``drafter/selector.hpp``: each row's ``selector_top_k`` largest logits, after
        ``output_multiplier`` and ``final_logit_softcapping``, scored with the previous drafted
        token's codebook row; greedy takes the best, ``temperature > 0`` samples softmax(S / T)).

        Args:
            hidden: ``[b - 1, H]`` the drafter's rows 1 .. b-1 (:meth:`draft`'s output without row 0).
            anchor_id: the block's first token (the last verified one): row 0's predecessor.
            lm_head: ``[V, H]`` the target's LM head weight (numpy or torch).
            temperature: 0 = greedy. seed: the draws' seed.

        Returns:
            ``(path, candidates, q)``: int64 ``[b - 1]`` the drafted tokens, int64 ``[b - 1, K]``
            each row's candidates (by descending logit), float32 ``[b - 1, K]`` the sampling
            distribution over them (``None`` when greedy).
        """
        h = _f32_rows(hidden)
        logits = np.ascontiguousarray(h @ _f32_rows(lm_head).T, dtype=np.float32)
        return self.propose_logits(h, logits, anchor_id, temperature, seed)

    def propose_logits(self, hidden, logits, anchor_id: int, temperature: float = 0.0, seed: int = 0):
        """:meth:`propose` with the LM head already applied: ``logits`` ``[b - 1, V]`` of ``hidden``'s
        rows (before the multiplier and the cap)."""
        return self._core.propose(_f32_rows(hidden), _f32_rows(logits), int(anchor_id), float(temperature), int(seed))

    def new_cache(self) -> "DraftCache":
        """A draft KV cache for one generation (C++ ``DraftCache``): :meth:`DraftCache.append` the
        target's hidden states as positions are accepted, :meth:`DraftCache.draft` a block from the
        cached K/V. A block then costs its own rows and attention over the cache, no O(context)
        projection (``draft`` recomputes the context's fusion and K/V every call). Equal to
        :meth:`draft` on the same context within f32 rounding (not bitwise: other GEMM row blocks
        and attention tiles)."""
        return DraftCache(self._core.new_cache())


class DraftCache:
    """The draft KV cache of one generation; make it with :meth:`Drafter.new_cache`. Collective
    over the drafter's communicator (every rank appends and drafts the same arrays)."""

    def __init__(self, core):
        self._core = core

    def append(self, target_hidden) -> None:
        """``target_hidden``: ``[n, n_t * H]`` the target's hidden states of the next ``n`` positions
        (as :meth:`Drafter.draft`'s ``target_hidden``, from position ``len(self)`` on)."""
        self._core.append(_f32_rows(target_hidden))

    def draft(self, noise_embedding) -> np.ndarray:
        """One block at positions ``len(self) ..``: ``noise_embedding`` ``[b, H]``, ``1 <= b <=
        block_size`` -> float32 ``[b, H]`` (as :meth:`Drafter.draft` with the appended context)."""
        return self._core.draft(_f32_rows(noise_embedding))

    def __len__(self) -> int:
        return self._core.__len__()

    @property
    def bytes(self) -> int:
        """Bytes of cached K/V on this rank (capacity included)."""
        return self._core.bytes
