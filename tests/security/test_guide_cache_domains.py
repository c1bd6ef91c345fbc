"""No team learns from timing whether another team recently used an exact schema.

The attack: the grammar check's verdict cache (text/guide_compile.py) and the engine's compiled
guide cache (engine/guided.py) were shared by every team, keyed by the schema alone. A hit
answers in microseconds, a compile takes milliseconds to seconds: team B timed a guessed schema
against a fresh one and learnt whether some team had just sent it. Now both caches are keyed by
(cache domain, spec): the domain is the request's `cache_salt` (its team, or its cache group),
as for the prefix cache, so another domain's entry is never a hit.

Real parts: llguidance compiling real guides, the checker on a real event loop, the engine's
compiler against SmolLM2's tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from engine.guided import GuidedDecoding
from protocol.structured import Guide, GuideKind
from text.guide_check import canonical_schema
from text.guide_compile import GuideChecker, Verdict

SCHEMA = Guide(
    kind=GuideKind.JSON_SCHEMA,
    spec=canonical_schema(
        {"type": "object", "properties": {"secret_field_of_team_a": {"type": "integer"}}}
    ),
)


async def test_a_verdict_is_a_hit_only_in_its_own_domain() -> None:
    compiles: list[Verdict] = []
    checker = GuideChecker(on_compile=compiles.append)
    try:
        await checker.check(SCHEMA, "response_format", domain="team-a")
        await checker.check(SCHEMA, "response_format", domain="team-a")
        assert compiles == [Verdict.OK]  # team A's resend is its own hit
        await checker.check(SCHEMA, "response_format", domain="team-b")
        assert compiles == [Verdict.OK, Verdict.OK]  # team B compiles: no hit on A's entry
        await checker.check(SCHEMA, "response_format")  # the unsalted domain is one more
        assert len(compiles) == 3
    finally:
        checker.close()


def test_a_compiled_guide_is_a_hit_only_in_its_own_domain(smollm2: Path) -> None:
    gd = GuidedDecoding(smollm2 / "tokenizer.json", 49152, frozenset({2}))
    try:
        gd.compile(SCHEMA, "team-a")
        gd.compile(SCHEMA, "team-a")
        assert (gd.compiled, gd.hits) == (1, 1)
        gd.compile(SCHEMA, "team-b")
        assert (gd.compiled, gd.hits) == (2, 1)
        gd.attach("r-b", SCHEMA, [], domain="team-b")  # a request uses its own domain's entry
        assert (gd.compiled, gd.hits) == (2, 2)
    finally:
        gd.close()
