"""diffcp.torch: the autograd Function on CPU torch tensors, f32 and bf16, against the fp64 reference
(gradcheck-style: analytic gradients of a scalar loss compared with fp64 ones; torch's own
gradcheck needs float64 kernels, which diffcp does not have)."""
import numpy as np
import pytest
import torch

import diffcp
import diffcp.torch as dtorch
from test_attention import ANCHORS, B, LENGTHS, normwise, problem, reference, storage_error


def leaves(rng, dtype, n_q=4, n_kv=2, d=16):
    q, k, v, do = problem(rng, n_q, n_kv, d)
    t = [torch.from_numpy(x).to(dtype) for x in (q, k, v)]
    for x in t:
        x.requires_grad_(True)
    return t, torch.from_numpy(do).to(dtype)


def test_f32_autograd_matches_fp64(rng):
    (q, k, v), do = leaves(rng, torch.float32)
    o = dtorch.dflash_attention(q, k, v, LENGTHS, ANCHORS, B)
    assert o.dtype == torch.float32 and o.requires_grad
    (o * do).sum().backward()
    ro, _, rdq, rdk, rdv = reference(*(x.detach().numpy() for x in (q, k, v)), do.numpy())
    for got, want, what in [(o.detach(), ro, "o"), (q.grad, rdq, "dq"), (k.grad, rdk, "dk"), (v.grad, rdv, "dv")]:
        err = np.abs(got.numpy() - want).max()
        assert err <= 2e-5 * max(1.0, np.abs(want).max()), f"{what}: max abs error {err}"


def test_bf16_autograd_within_3x_storage_error(rng):
    (q, k, v), do = leaves(rng, torch.bfloat16)
    o, lse = dtorch.dflash_attention(q, k, v, LENGTHS, ANCHORS, B, return_lse=True)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32 and not lse.requires_grad
    (o.float() * do.float()).sum().backward()
    assert q.grad.dtype == torch.bfloat16
    f64 = [x.detach().double().numpy() for x in (q, k, v, do)]
    ro, rlse, rdq, rdk, rdv = reference(*f64)
    for got, want, what in [(o.detach(), ro, "o"), (q.grad, rdq, "dq"), (k.grad, rdk, "dk"), (v.grad, rdv, "dv")]:
        err, floor = normwise(got.double().numpy(), want), storage_error(want)
        assert err <= 3 * floor + 1e-6, f"{what}: normwise error {err}, bf16 storage error {floor}"


def test_outputs_share_memory_with_what_the_kernel_wrote(rng):
    """Zero copy: the tensors returned are the buffers the C++ kernel filled (numpy views of them)."""
    (q, k, v), _ = leaves(rng, torch.float32)
    o, lse = diffcp.attention.forward(q.detach(), k.detach(), v.detach(), LENGTHS, ANCHORS, B)
    assert isinstance(o, torch.Tensor) and o.is_contiguous()
    o.numpy()[0, 0, 0] = 42.0  # the numpy view is the tensor's memory
    assert o[0, 0, 0].item() == 42.0


def test_bad_tensors_are_python_errors(rng):
    (q, k, v), _ = leaves(rng, torch.float32)
    with pytest.raises(TypeError, match="expected torch.float32 or torch.bfloat16, got torch.float64"):
        dtorch.dflash_attention(q.double(), k, v, LENGTHS, ANCHORS, B)
    with pytest.raises(TypeError, match="mixed numpy arrays and torch tensors"):
        diffcp.attention.forward(q.detach(), k.detach().numpy(), v.detach(), LENGTHS, ANCHORS, B)
    with pytest.raises(TypeError, match=r"k: expected a numpy float32 array"):
        dtorch.dflash_attention(q, k.bfloat16(), v, LENGTHS, ANCHORS, B)
    with pytest.raises(ValueError, match="anchor"):
        dtorch.dflash_attention(q, k, v, LENGTHS, [np.array([10, 20, 38]), np.array([12])], B)
