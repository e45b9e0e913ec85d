"""diffcp.attention forward/backward against a dense fp64 numpy reference of the DFlash mask."""
import numpy as np
import pytest

import diffcp
from conftest import packed

LENGTHS = np.array([40, 30])
ANCHORS = [np.array([10, 20, 31]), np.array([12])]
B = 4


def problem(rng, n_q=4, n_kv=2, d=8):
    S = int(LENGTHS.sum())
    Q = sum(len(a) for a in ANCHORS) * B
    q = rng.standard_normal((Q, n_q, d)).astype(np.float32)
    k = rng.standard_normal((S + Q, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((S + Q, n_kv, d)).astype(np.float32)
    do = rng.standard_normal((Q, n_q, d)).astype(np.float32)
    return q, k, v, do


def dense_mask(Q):
    S = int(LENGTHS.sum())
    _, blocks = packed(LENGTHS, ANCHORS)
    m = np.zeros((Q, S + Q), bool)
    for i, (s, a) in enumerate(blocks):
        m[i * B:(i + 1) * B, s:a] = True
        m[i * B:(i + 1) * B, S + i * B:S + (i + 1) * B] = True
    return m


def reference(q, k, v, do):
    """fp64 forward (o, lse) and backward (dq, dk, dv) per query head, GQA by head groups."""
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    Q, n_q, d = q.shape
    G = n_q // k.shape[1]
    scale = 1 / np.sqrt(d)
    mask = dense_mask(Q)
    o = np.zeros_like(q); lse = np.zeros((Q, n_q)); dq = np.zeros_like(q)
    dk = np.zeros_like(k); dv = np.zeros_like(v)
    for h in range(n_q):
        kh, vh = k[:, h // G], v[:, h // G]
        s = np.where(mask, scale * q[:, h] @ kh.T, -np.inf)
        m = s.max(axis=1, keepdims=True)
        p = np.exp(s - m)
        lse[:, h] = (m + np.log(p.sum(axis=1, keepdims=True)))[:, 0]
        p /= p.sum(axis=1, keepdims=True)
        o[:, h] = p @ vh
        dp = do[:, h] @ vh.T
        ds = p * (dp - (do[:, h] * o[:, h]).sum(axis=1, keepdims=True))
        dq[:, h] = scale * ds @ kh
        dk[:, h // G] += scale * ds.T @ q[:, h]
        dv[:, h // G] += p.T @ do[:, h]
    return o, lse, dq, dk, dv


def close(got, want, what):
    err = np.abs(got - want).max()
    assert err <= 2e-5 * max(1.0, np.abs(want).max()), f"{what}: max abs error {err}"


@pytest.mark.parametrize("n_q, n_kv", [(4, 2), (4, 4), (8, 1)])
def test_forward_backward_match_fp64(rng, n_q, n_kv):
    q, k, v, do = problem(rng, n_q, n_kv)
    o, lse = diffcp.attention.forward(q, k, v, LENGTHS, ANCHORS, B)
    assert o.dtype == np.float32 and o.shape == q.shape and lse.shape == q.shape[:2]
    dq, dk, dv = diffcp.attention.backward(q, k, v, o, lse, do, LENGTHS, ANCHORS, B)
    ro, rlse, rdq, rdk, rdv = reference(q, k, v, do)
    for got, want, what in [(o, ro, "o"), (lse, rlse, "lse"), (dq, rdq, "dq"), (dk, rdk, "dk"), (dv, rdv, "dv")]:
        close(got, want, what)


def test_inputs_are_used_in_place_and_not_modified(rng):
    q, k, v, _ = problem(rng)
    before = q.copy()
    diffcp.attention.forward(q, k, v, LENGTHS, ANCHORS, B)
    np.testing.assert_array_equal(q, before)


def test_bad_arrays_are_python_errors(rng):
    q, k, v, do = problem(rng)
    f = diffcp.attention.forward
    with pytest.raises(TypeError, match=r"q: expected a numpy float32 array or uint16 \(bf16 bits\), got dtype float64"):
        f(q.astype(np.float64), k, v, LENGTHS, ANCHORS, B)
    with pytest.raises(ValueError, match="k: array must be C-contiguous"):
        f(q, np.asfortranarray(k), v, LENGTHS, ANCHORS, B)
    with pytest.raises(ValueError, match=r"v: shape \[85, 2, 8\], expected \[86, 2, 8\]"):
        f(q, k, v[:-1].copy(), LENGTHS, ANCHORS, B)
    with pytest.raises(ValueError, match="n_q = 4 is not a multiple of n_kv = 3"):
        f(q, np.zeros((k.shape[0], 3, 8), np.float32), np.zeros((k.shape[0], 3, 8), np.float32), LENGTHS, ANCHORS, B)
    with pytest.raises(ValueError, match="anchor"):
        f(q, k, v, LENGTHS, [np.array([10, 20, 38]), np.array([12])], B)
    o, lse = f(q, k, v, LENGTHS, ANCHORS, B)
    with pytest.raises(ValueError, match=r"lse: shape"):
        diffcp.attention.backward(q, k, v, o, lse[:-1].copy(), do, LENGTHS, ANCHORS, B)
    with pytest.raises(TypeError, match=r"k: expected a numpy uint16 \(bf16 bits\) array, got dtype float32"):
        f(diffcp.to_bf16(q), k, v, LENGTHS, ANCHORS, B)
    with pytest.raises(TypeError, match="expected a numpy array or a torch tensor, got list"):
        f(q.tolist(), k, v, LENGTHS, ANCHORS, B)


def normwise(got, want):
    return np.abs(got - want).max() / np.abs(want).max()


def storage_error(want):
    """The normwise error of merely storing the exact result in bf16 (what an ideal kernel has)."""
    return normwise(diffcp.from_bf16(diffcp.to_bf16(want.astype(np.float32))).astype(np.float64), want)


@pytest.mark.parametrize("n_q, n_kv", [(4, 2), (8, 1)])
def test_bf16_within_3x_storage_error_of_fp64(rng, n_q, n_kv):
    """bf16 bits in, bf16 bits out; the reference runs in fp64 on the same bf16 numbers. Gate as in
    the C++ tests: each output within 3x the error of storing the exact result in bf16."""
    q, k, v, do = (diffcp.to_bf16(x) for x in problem(rng, n_q, n_kv, d=64))
    o, lse = diffcp.attention.forward(q, k, v, LENGTHS, ANCHORS, B)
    assert o.dtype == np.uint16 and lse.dtype == np.float32
    dq, dk, dv = diffcp.attention.backward(q, k, v, o, lse, do, LENGTHS, ANCHORS, B)
    ro, rlse, rdq, rdk, rdv = reference(*(diffcp.from_bf16(x) for x in (q, k, v, do)))
    for got, want, what in [(o, ro, "o"), (dq, rdq, "dq"), (dk, rdk, "dk"), (dv, rdv, "dv")]:
        err, floor = normwise(diffcp.from_bf16(got).astype(np.float64), want), storage_error(want)
        assert err <= 3 * floor + 1e-6, f"{what}: normwise error {err}, bf16 storage error {floor}"
    assert np.abs(lse - rlse).max() <= 2 ** -10


def test_bf16_round_trip_is_round_to_nearest_even():
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, -2.5, np.inf, 0.0], np.float32)
    b = diffcp.to_bf16(x)
    assert b.dtype == np.uint16
    np.testing.assert_array_equal(diffcp.from_bf16(b), np.array([1.0, 1.0, 1 + 4 * 2 ** -8, -2.5, np.inf, 0.0], np.float32))
    assert "bf16" in diffcp.bf16_path()


def test_cpu_kernels_name_the_isa_that_runs():
    k = diffcp.cpu_kernels()
    assert any(f"({isa} kernels" in k for isa in ("avx512", "avx2", "generic", "native")), k
