"""diffcp.SplitKV at P ranks (mpirun -np P python -m pytest python/tests_mpi) equals the same layer
run single-process on every rank (MPI.COMM_SELF): outputs, input gradients and summed weight
gradients, with contiguous slices and with an LPT plan; bytes sent equal the closed form."""
import numpy as np
import pytest
from mpi4py import MPI

import diffcp

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
CFG = diffcp.LayerConfig(hidden=48, n_q=4, n_kv=2, d_h=16)
LENGTHS = np.array([120, 90, 150])
ANCHORS = [np.array([40, 60, 90]), np.array([30, 50]), np.array([60, 100, 120, 130])]
B = 8


def inputs(seed):
    """x [Q, H], ctx [S, H], dy [Q, H] of the whole batch, float32, the same on every rank."""
    rng = np.random.default_rng(seed)
    S, Q = int(LENGTHS.sum()), sum(len(a) for a in ANCHORS) * B
    return tuple(rng.standard_normal((n, CFG.hidden)).astype(np.float32) for n in (Q, S, Q))


def close(got, want, what):
    err = float(np.abs(got - want).max()) if got.size else 0.0
    assert err <= 1e-4 * max(1.0, float(np.abs(want).max())), f"rank {RANK}: {what}: max abs error {err}"


@pytest.mark.parametrize("use_plan", [False, True])
def test_splitkv_equals_single_process(use_plan):
    X, CTX, DY = inputs(7)

    single = diffcp.SplitKV(MPI.COMM_SELF, CFG, LENGTHS, ANCHORS, B)
    w = single.init_params(3)
    y1, s1 = single.forward(w, X, CTX)
    dx1, dctx1, g1 = single.backward(s1, w, DY)

    plan = diffcp.plan(LENGTHS, ANCHORS, B, P, J=2) if use_plan else None
    layer = diffcp.SplitKV(COMM, CFG, LENGTHS, ANCHORS, B, plan=plan)
    q0, q1 = layer.owned_query_rows
    rows = np.concatenate([np.arange(b, e) for b, e in layer.context_chunks] or [np.zeros(0, np.int64)])
    ctx = np.ascontiguousarray(CTX[rows])
    sent0 = layer.bytes_sent
    y, saved = layer.forward(w, X[q0:q1].copy(), ctx)
    dx, dctx, g = layer.backward(saved, w, DY[q0:q1].copy())
    sent = COMM.allreduce(layer.bytes_sent - sent0)
    g_all = np.empty_like(g)
    COMM.Allreduce(g, g_all)

    close(y, y1[q0:q1], "y")
    close(dx, dx1[q0:q1], "dx")
    close(dctx, dctx1[rows], "dctx")
    close(g_all, g1, "weight gradients")
    assert sent / P == pytest.approx(layer.predicted_bytes_per_layer, rel=1e-9)
    if P == 1:
        assert sent == 0


def test_saved_context_is_consumed_once():
    layer = diffcp.SplitKV(COMM, CFG, LENGTHS, ANCHORS, B)
    w = layer.init_params(1)
    q0, q1 = layer.owned_query_rows
    C = sum(e - b for b, e in layer.context_chunks)
    x = np.zeros((q1 - q0, CFG.hidden), np.float32)
    y, saved = layer.forward(w, x, np.zeros((C, CFG.hidden), np.float32))
    layer.backward(saved, w, x)
    with pytest.raises(ValueError):
        layer.backward(saved, w, x)


def test_bad_arguments():
    with pytest.raises(TypeError, match="mpi4py communicator"):
        diffcp.SplitKV(object(), CFG, LENGTHS, ANCHORS, B)
    wrong = diffcp.plan(LENGTHS, ANCHORS, B, P + 1, J=2)
    with pytest.raises(ValueError, match=f"made for P = {P + 1}"):
        diffcp.SplitKV(COMM, CFG, LENGTHS, ANCHORS, B, plan=wrong)
    layer = diffcp.SplitKV(COMM, CFG, LENGTHS, ANCHORS, B)
    w = layer.init_params(1)
    q0, q1 = layer.owned_query_rows
    with pytest.raises(ValueError, match=r"x: shape"):
        layer.forward(w, np.zeros((q1 - q0 + 1, CFG.hidden), np.float32), np.zeros((0, CFG.hidden), np.float32))
    with pytest.raises(TypeError, match="params: expected a numpy float32 array"):
        layer.forward(w.astype(np.float64), np.zeros((q1 - q0, CFG.hidden), np.float32), np.zeros((0, CFG.hidden), np.float32))


def test_bf16_within_2_5x_single_process_bf16_error():
    """dtype="bf16": against the f32 single-process layer, every output's error at P ranks is at most
    2.5x that of the bf16 layer on COMM_SELF (+ 2^-12 of the peak); bytes are the bf16 closed form."""
    X, CTX, DY = inputs(11)
    ref = diffcp.SplitKV(MPI.COMM_SELF, CFG, LENGTHS, ANCHORS, B)
    w = ref.init_params(3)
    y0, s0 = ref.forward(w, X, CTX)
    dx0, dctx0, g0 = ref.backward(s0, w, DY)
    one = diffcp.SplitKV(MPI.COMM_SELF, CFG, LENGTHS, ANCHORS, B, dtype="bf16")
    y1, s1 = one.forward(w, X, CTX)
    dx1, dctx1, g1 = one.backward(s1, w, DY)

    layer = diffcp.SplitKV(COMM, CFG, LENGTHS, ANCHORS, B, dtype="bf16")
    q0, q1 = layer.owned_query_rows
    rows = np.concatenate([np.arange(b, e) for b, e in layer.context_chunks] or [np.zeros(0, np.int64)])
    sent0 = layer.bytes_sent
    y, saved = layer.forward(w, X[q0:q1].copy(), np.ascontiguousarray(CTX[rows]))
    dx, dctx, g = layer.backward(saved, w, DY[q0:q1].copy())
    sent = COMM.allreduce(layer.bytes_sent - sent0)
    g_all = np.empty_like(g)
    COMM.Allreduce(g, g_all)

    def err(a, b):
        return COMM.allreduce(float(np.abs(a - b).max()) if a.size else 0.0, op=MPI.MAX)

    for what, got, one_rank, f32 in [("y", y, y1[q0:q1], y0[q0:q1]), ("dx", dx, dx1[q0:q1], dx0[q0:q1]),
                                     ("dctx", dctx, dctx1[rows], dctx0[rows]), ("weight gradients", g_all, g1, g0)]:
        peak = COMM.allreduce(float(np.abs(f32).max()) if f32.size else 0.0, op=MPI.MAX)
        e_p, e_1 = err(got, f32), err(one_rank, f32)
        assert e_1 > 2 ** -14 * peak, f"{what}: the bf16 path did not round anything"
        assert e_p <= 2.5 * e_1 + 2 ** -12 * peak, f"rank {RANK}: {what}: error {e_p} at P = {P}, one rank {e_1}"
    assert sent / P == pytest.approx(layer.predicted_bytes_per_layer, rel=1e-9)
    with pytest.raises(ValueError, match="dtype 'fp8': expected f32 or bf16"):
        diffcp.SplitKV(COMM, CFG, LENGTHS, ANCHORS, B, dtype="fp8")


@pytest.mark.parametrize("method", ["splitkv", "ring", "lvxattn"])
def test_run_layer_is_the_library_run(method):
    """diffcp.run_layer is the library's measured layer run (what `diffcp attn` runs): it passes the
    fp64 check, its bytes equal the method's closed form, and the same call is the same on every rank."""
    r = diffcp.run_layer(COMM, CFG, method=method, layout="lpt" if method == "splitkv" else "none", samples=2,
                         context=160, queries=32, block=8, J=2, warmup=0, reps=2, check=True)
    assert r["checked"] and r["check_passed"], r
    assert r["max_rel_err"] < 1e-4, r
    assert r["bytes_per_layer"] == pytest.approx(r["predicted_bytes_per_layer"], rel=1e-12), r
    assert r["step_ms"] > 0
    both = COMM.allgather((r["bytes_per_layer"], r["check_passed"]))
    assert all(b == both[0] for b in both)
    with pytest.raises(ValueError, match="queries = 30 per sample, block = 8"):
        diffcp.run_layer(COMM, CFG, queries=30, block=8)


@pytest.mark.parametrize("method", ["splitkv", "ring", "lvxattn"])
def test_rendezvous_transport(method):
    """comm="rendezvous": MPI.COMM_WORLD on NCCL's semantics made strict (docs/gpu.md); the layer
    run passes the fp64 check, with the bytes of the method's closed form."""
    kw = dict(method=method, samples=2, context=160, queries=32, block=8, J=2, warmup=0, reps=1, check=True)
    r = diffcp.run_layer("rendezvous", CFG, **kw)
    assert r["check_passed"], r
    # the closed form (Split-KV's lse all-reduce is max + sum there: NCCL has no logsumexp)
    assert r["bytes_per_layer"] == pytest.approx(r["predicted_bytes_per_layer"], rel=1e-12), r
    with pytest.raises(ValueError, match="expected an mpi4py communicator, 'mpi' or 'rendezvous'"):
        diffcp.run_layer("gloo", CFG)
