"""Step-time noise for sensitivity runs: how much a case's predicted figures move when every
simulated step lasts a little more or less than the profile's model says, as real steps do.

A real run of the same schedule twice does not repeat itself exactly: each step's time varies
by a few percent (the machine's other tenants, caches, the OS), and where a routing or
scheduling choice turns on timings a few hundred ms apart (which node is less loaded when the
next prompt arrives; whether a prompt's chunk lands during another request's decode), those few
percent decide it. Re-simulating a case with seeded noise shows whether its figures are a
property of the workload or of the noise: a figure that moves by more than the validation bar
under noise the size of the step model's own error cannot be predicted to that bar by any
simulator, nor repeated by the real system.

Invariants: a factor is lognormal with mean exactly 1 (so the noise adds no bias to the mean
step); one `StepJitter` per node, seeded from (seed, node index), so a run is reproducible and
nodes do not share a stream; sigma 0 is no noise at all (the factor is exactly 1.0).
"""

from __future__ import annotations

import math
import random


class StepJitter:
    def __init__(self, sigma: float, seed: int) -> None:
        if not (sigma >= 0 and math.isfinite(sigma)):
            raise ValueError(f"step jitter sigma must be a finite number >= 0, got {sigma!r}")
        self.sigma = sigma
        self._rng = random.Random(seed)
        # mu = -sigma²/2 makes E[factor] = 1: the noise spreads step times without biasing them
        self._mu = -sigma * sigma / 2

    def factor(self) -> float:
        return 1.0 if self.sigma == 0 else self._rng.lognormvariate(self._mu, self.sigma)
