"""diffcp.plan against an independent numpy evaluation of SPEC A.3's cost model."""
import numpy as np
import pytest

import diffcp
from conftest import packed


def random_batch(rng, b=4, lo=200, hi=600, per=6, B=8):
    lengths = rng.integers(lo, hi, size=b)
    anchors = [np.sort(rng.choice(np.arange(int(L * 0.25), L - B + 1), size=per, replace=False)) for L in lengths]
    return lengths, anchors, B


def numpy_loads(lengths, anchors, B, plan):
    """C_p from c(x) = B * #{blocks i: s_i <= x < a_i}; D_p = owned blocks * B^2 (even contiguous ownership)."""
    S = int(np.sum(lengths))
    _, blocks = packed(lengths, anchors)
    c = np.zeros(S, np.int64)
    for s, a in blocks:
        c[s:a] += B
    C = np.zeros(plan.P, np.int64)
    for (beg, end), r in zip(plan.chunks, plan.rank):
        C[r] += c[beg:end].sum()
    N = len(blocks)
    owned = np.array([(p + 1) * N // plan.P - p * N // plan.P for p in range(plan.P)])
    return C, owned * B * B


@pytest.mark.parametrize("balancer", ["none", "zigzag", "lpt", "partition"])
@pytest.mark.parametrize("P", [1, 2, 3, 8])
def test_plan_partitions_context_and_loads_match_numpy(rng, balancer, P):
    lengths, anchors, B = random_batch(rng)
    plan = diffcp.plan(lengths, anchors, B, P, J=4, balancer=balancer)
    S = int(np.sum(lengths))
    assert plan.balancer == balancer and plan.P == P
    assert plan.J == {"none": 1, "zigzag": 2}.get(balancer, 4)  # what the balancer used
    assert plan.chunks.dtype == np.int64 and plan.chunks.shape[1] == 2
    assert plan.chunks[0, 0] == 0 and plan.chunks[-1, 1] == S
    assert np.all(plan.chunks[1:, 0] == plan.chunks[:-1, 1])
    assert plan.rank.min() >= 0 and plan.rank.max() < P
    C, D = numpy_loads(lengths, anchors, B, plan)
    np.testing.assert_array_equal(plan.context_work, C)
    np.testing.assert_array_equal(plan.block_work, D)
    np.testing.assert_array_equal(plan.rank_work, C + D)
    W = (C + D).astype(float)
    assert plan.rho == pytest.approx(W.max() / W.mean())
    assert plan.imbalance_pct == pytest.approx(100 * (plan.rho - 1))
    held = np.concatenate([plan.chunks_of_rank(p) for p in range(P)])
    assert sorted(map(tuple, held)) == sorted(map(tuple, plan.chunks))


@pytest.mark.parametrize("windows", [[0, 0], [5, 0], [37, 37, 0], [3]])
def test_windowed_loads_match_numpy(rng, windows):
    """Sliding layers (issue #36): slot r of a block at anchor a sees context x iff a + r - x < W;
    the loads sum the layers (a full layer: B per block that sees x); D counts each layer's causal
    in-block pairs."""
    lengths, anchors, B = random_batch(rng)
    plan = diffcp.plan(lengths, anchors, B, 3, J=4, windows=windows)
    _, blocks = packed(lengths, anchors)
    c = np.zeros(int(np.sum(lengths)), np.int64)
    own = 0
    r = np.arange(B)
    for W in windows:
        for s, a in blocks:
            for x in range(s, a):
                c[x] += B if W == 0 else np.sum(a + r - x < W)
        own += B * B if W == 0 else sum(int(np.sum((j <= r) & (r - j < W))) for j in range(B))
    C = np.zeros(3, np.int64)
    for (beg, end), rk in zip(plan.chunks, plan.rank):
        C[rk] += c[beg:end].sum()
    np.testing.assert_array_equal(plan.context_work, C)
    N = len(blocks)
    owned = np.array([(p + 1) * N // 3 - p * N // 3 for p in range(3)])
    np.testing.assert_array_equal(plan.block_work, owned * own)


def test_lpt_balances_a_skewed_batch_better_than_contiguous(rng):
    # One long sample with late anchors and short ones: contiguous slices are badly unbalanced.
    lengths = np.array([4000, 300, 300, 300])
    anchors = [np.arange(3000, 3990, 10), np.array([200]), np.array([250]), np.array([100])]
    none = diffcp.plan(lengths, anchors, 8, 8, balancer="none")
    lpt = diffcp.plan(lengths, anchors, 8, 8, J=16, balancer="lpt")
    assert lpt.imbalance_pct < none.imbalance_pct / 4


def test_lists_and_numpy_inputs_agree(rng):
    lengths, anchors, B = random_batch(rng)
    a = diffcp.plan(lengths, anchors, B, 4)
    b = diffcp.plan([int(x) for x in lengths], [[int(x) for x in an] for an in anchors], B, 4)
    np.testing.assert_array_equal(a.chunks, b.chunks)
    np.testing.assert_array_equal(a.rank, b.rank)
    assert set(diffcp.balancer_names()) == {"none", "zigzag", "lpt", "partition"}


@pytest.mark.parametrize("args, err, match", [
    (([100.5, 50], [[10], [5]], 4, 2), TypeError, "lengths: expected integers"),
    (([[100, 50]], [[10], [5]], 4, 2), ValueError, "lengths: expected a 1-D array"),
    (([100, 50], [[10]], 4, 2), ValueError, "1 arrays for 2 samples"),
    (([100, 50], [[10], [48]], 4, 2), ValueError, "anchor"),
    (([100, 50], [[10], [-1]], 4, 2), ValueError, "anchor"),
    (([100, 50], [[10], [5.0]], 4, 2), TypeError, r"anchors\[1\]: expected integers"),
    (([100, 50], [[20, 10], [5]], 4, 2), ValueError, "increasing"),
    (([100, 50], [[10], [5]], 4, 0), ValueError, "P = 0"),
    (([10, 5], [[2], [1]], 4, 4), ValueError, "P\\*J"),
    (([100, 50], [[10], [5]], 0, 2), ValueError, "B"),
])
def test_bad_input_is_a_python_error(args, err, match):
    with pytest.raises(err, match=match):
        diffcp.plan(*args)


def test_unknown_balancer_and_rank():
    with pytest.raises(ValueError, match="metis"):
        diffcp.plan([100], [[10]], 4, 2, balancer="metis")
    plan = diffcp.plan([100], [[10]], 4, 2, J=2)
    with pytest.raises(ValueError, match="p = 2"):
        plan.chunks_of_rank(2)
