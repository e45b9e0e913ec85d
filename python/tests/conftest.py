import numpy as np
import pytest


def packed(lengths, anchors):
    """Sample starts s_u and, per block, (s_i, packed anchor a_i)."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    blocks = [(int(starts[u]), int(starts[u] + a)) for u in range(len(lengths)) for a in anchors[u]]
    return starts, blocks


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
