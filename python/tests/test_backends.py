"""diffcp.backends() and the backend= argument (issue #51): the CPU is listed with what runs each
dtype; an unknown backend is a ValueError naming the registered ones, before anything is built."""
import pytest

import diffcp


def test_backends_lists_the_cpu():
    names = {b["name"]: b for b in diffcp.backends()}
    assert names["cpu"]["device"] == "host"
    assert names["cpu"]["f32"].startswith("cpu (") and names["cpu"]["bf16"].startswith("cpu (")


def test_an_unknown_backend_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="unknown backend 'cuda'; registered backends: cpu"):
        diffcp.Drafter.load(tmp_path, backend="cuda")
    cfg = diffcp.LayerConfig(hidden=32, n_q=2, n_kv=1, d_h=16)
    from mpi4py import MPI
    with pytest.raises(ValueError, match="backend 'opencl'"):
        diffcp.SplitKV(MPI.COMM_SELF, cfg, [40], [[20]], 4, backend="opencl")
