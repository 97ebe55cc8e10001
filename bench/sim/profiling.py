"""The Conductor's prefill-time predictor, fitted as the paper does: on offline profiling data.

The simulated instances run the FLOP model exactly; the "profile" samples it on a grid of
prompt lengths and prefix hits with seeded multiplicative noise (measurement jitter), and the
Conductor predicts with the polynomial fitted to that profile, not with the true model.
"""

from __future__ import annotations

import numpy as np

from cluster.policies.cost_model import PrefillCostModel


def fit_prefill_predictor(true_model: PrefillCostModel, noise: float, seed: int) -> PrefillCostModel:
    rng = np.random.default_rng([seed, 7])
    lengths = np.geomspace(256, 131072, 24).round().astype(int)
    hits = (0.0, 0.25, 0.5, 0.75, 0.95)
    n_col, p_col, t_col = [], [], []
    for n in lengths:
        for h in hits:
            p = int(n * h)
            n_col.append(int(n))
            p_col.append(p)
            t_col.append(true_model.seconds(int(n), p) * (1.0 + noise * rng.standard_normal()))
    return PrefillCostModel.fit(n_col, p_col, t_col)
