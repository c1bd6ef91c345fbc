"""Send times of an open-loop run: a gamma process of the configured request rate.

Burstiness is the gamma shape: 1 gives a Poisson process (exponential gaps), below 1 burstier
traffic, above 1 more regular; the mean gap is always 1/rate. An infinite rate sends every
request at t = 0 (then only --max-concurrency paces the run: a closed loop).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator


def send_offsets(rate: float, burstiness: float, rng: random.Random) -> Iterator[float]:
    """Offsets (seconds from the start) of successive sends; endless."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be positive")
    t = 0.0
    while True:
        if not math.isinf(rate):
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        yield t
