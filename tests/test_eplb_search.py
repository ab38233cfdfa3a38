"""eplb.search.improve: rows that reach their target drop out together with all their per-row arrays."""

import numpy as np
import pytest

from eplb.search import improve, robust_max


def _case(seed, X=4, G=6, m=3, S=3):
    rng = np.random.default_rng(seed)
    n = G * m
    phy = np.stack([rng.permutation(n).reshape(G, m) for _ in range(X)])
    ws = rng.random((X, S, n)) * rng.zipf(1.5, size=(X, 1, n))
    return phy, ws


@pytest.mark.parametrize("seed, G, m", [(0, 6, 3), (1, 6, 3), (2, 8, 2), (3, 5, 4)])
def test_target_drops_rows_consistently_with_few_partners(seed, G, m):
    phy, ws = _case(seed, G=G, m=m)
    start = robust_max(phy, ws, 2.0)
    # Row 0 is done at once (target above its load), the others have unreachable targets.
    target = np.where(np.arange(4) == 0, start + 1.0, 0.0)
    got = phy.copy()
    improve(got, ws, 2.0, 20, target=target, num_partners=2)
    assert (got[0] == phy[0]).all()
    for x in range(1, 4):  # every other row ran as it would alone
        alone = phy[x:x + 1].copy()
        improve(alone, ws[x:x + 1], 2.0, 20, target=target[x:x + 1], num_partners=2)
        assert (got[x] == alone[0]).all()
    assert (robust_max(got, ws, 2.0)[1:] <= start[1:]).all()
