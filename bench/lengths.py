"""Length distributions for synthetic prompts and outputs, written on the command line as
`N` (fixed), `uniform:LO,HI`, `normal:MEAN,STD` or `lognormal:MEDIAN,SIGMA`; every draw is
clipped to [1, `limit`] so a tail never asks for a zero-token prompt or a huge one.

Invariant: sampling uses only the caller's random.Random, so a seed fixes every length.
"""

from __future__ import annotations

import math
import random

import msgspec

KINDS = ("fixed", "uniform", "normal", "lognormal")
HELP = "N | uniform:LO,HI | normal:MEAN,STD | lognormal:MEDIAN,SIGMA"


class LengthDist(msgspec.Struct, frozen=True, kw_only=True):
    kind: str = "fixed"
    a: float
    b: float = 0.0
    limit: int = 1 << 20

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            x = self.a
        elif self.kind == "uniform":
            return max(1, min(self.limit, rng.randint(int(self.a), int(self.b))))
        elif self.kind == "normal":
            x = rng.gauss(self.a, self.b)
        else:
            x = rng.lognormvariate(math.log(self.a), self.b)
        return max(1, min(self.limit, round(x)))

    @property
    def mean(self) -> float:
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        if self.kind == "lognormal":
            return self.a * math.exp(self.b**2 / 2)
        return self.a

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        return f"{self.kind}:{self.a:g},{self.b:g}"


def parse_length(spec: str) -> LengthDist:
    """`128`, `uniform:64,256`, `normal:128,16`, `lognormal:128,0.8` → LengthDist (ValueError
    with the accepted forms otherwise)."""
    text = spec.strip()
    kind, sep, rest = text.partition(":")
    try:
        if not sep:
            n = int(text)
            if n < 1:
                raise ValueError
            return LengthDist(kind="fixed", a=n)
        parts = [float(x) for x in rest.split(",")]
    except ValueError:
        raise ValueError(f"cannot read length {spec!r}: use {HELP}") from None
    if kind not in KINDS[1:] or len(parts) != 2:
        raise ValueError(f"cannot read length {spec!r}: use {HELP}")
    a, b = parts
    if kind == "uniform" and not 1 <= a <= b:
        raise ValueError(f"uniform:{a:g},{b:g} needs 1 <= LO <= HI")
    if kind in ("normal", "lognormal") and (a <= 0 or b < 0):
        raise ValueError(f"{kind}:{a:g},{b:g} needs a positive centre and a non-negative spread")
    return LengthDist(kind=kind, a=a, b=b)
