"""The grammar check of a request's guide, off the event loop, bounded in threads and in time.

`check_guide` (text/guide_check.py) compiles a guide's grammar with llguidance; a
pathological one takes seconds (a 97k-character JSON schema of 9,800 optional properties took
13 s on the 2-core dev machine; the figures are in docs/structured-outputs.md). Run on the event
loop, that stalled every other request and stream of every team. `GuideChecker.check` instead:

- answers from a bounded LRU of verdicts keyed by (cache domain, kind, sha256 of the spec), so
  a schema a client resends with every request is compiled once; a compile already running for
  the same key is awaited, not started again. The domain (a team's, or its cache group's: the
  prefix cache's) keeps one team from timing another's entries: a hit answers in microseconds
  where a compile takes milliseconds to seconds, so a shared verdict would tell team B whether
  some team recently sent an exact schema;
- runs the compile in its own pool of `threads` threads (llguidance releases the GIL while it
  compiles), so a flood of bad schemas holds at most `threads` threads and never the loop or
  the default executor that tokenizing and the store use;
- runs at most `domain_threads` compiles of one cache domain at once (the gateway gives a team
  half the threads): a team's burst of distinct schemas waits for its own share, in the same
  bounded wait, instead of filling the pool that every other team's structured outputs need;
- waits for a free thread at most `timeout_s` (then 503 `overloaded`, retryable: the pool is
  busy with others' compiles), and for the compile at most `timeout_s` from its start (then
  400 "too complex to compile within N s" naming the request field; the verdict is cached, so
  the same guide resent is refused at once).

llguidance cannot be interrupted: a compile past its time limit keeps its thread until it ends,
and its slot in the bound is given back only then — so `threads` bounds the CPU that slow
compiles take, however many clients send them; more waiting than `max_waiting` is a 503 at
once. text/guide_check.py's size bounds keep the slowest admitted compile to about a second.

Invariant: `check` returns only for a guide the grammar engine accepted (or None); otherwise it
raises APIError — 400 for an invalid or too complex guide, 503 when the pool is busy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from protocol.openai import APIError
from protocol.structured import Guide
from text.guide_check import WHAT, GrammarEngineMissing, grammar_error_uncached

log = logging.getLogger("duet.guide")

#: default seconds a compile may take (the slowest guide the size bounds admit compiles in
#: about a second on a loaded 2-core machine)
TIMEOUT_S = 5.0
#: default threads compiling at once (each holds a core while it compiles)
THREADS = 2
#: verdicts kept (a key is ~100 bytes, a refusal's message at most a few hundred)
CACHE_SIZE = 1024
#: compiles that may wait for a thread at once; more are refused with a 503 at once
MAX_WAITING = 64


class Verdict(enum.Enum):
    """What a compile found."""

    OK = "ok"
    INVALID = "invalid"
    TOO_COMPLEX = "too_complex"
    #: llguidance cannot be imported (never cached: a fixed install should be seen)
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True)
class Outcome:
    verdict: Verdict
    #: why the engine refused it (INVALID, UNAVAILABLE)
    why: str | None = None


class _Busy(Exception):
    """No thread came free within the time limit, or too many compiles wait."""


Key = tuple[str, str, str]


def key(guide: Guide, domain: str | None = None) -> Key:
    """The cache key of `guide` checked for cache domain `domain` (None: the shared one)."""
    return domain or "", guide.kind.value, hashlib.sha256(guide.spec.encode()).hexdigest()


class GuideChecker:
    """Checks guides for one event loop. `on_compile(verdict)` is called on the loop once per
    compile that ends (a timed-out one when its thread ends too), `running(n)` whenever the number
    of compiles running on threads changes: the gateway counts them in its metrics."""

    def __init__(
        self,
        timeout_s: float = TIMEOUT_S,
        threads: int = THREADS,
        cache_size: int = CACHE_SIZE,
        max_waiting: int = MAX_WAITING,
        on_compile: Callable[[Verdict], None] | None = None,
        running: Callable[[int], None] | None = None,
        domain_threads: int | None = None,
    ) -> None:
        if timeout_s <= 0 or threads < 1 or cache_size < 1 or max_waiting < 0:
            raise ValueError("timeout_s must be > 0, threads and cache_size >= 1, max_waiting >= 0")
        if domain_threads is not None and not 1 <= domain_threads <= threads:
            raise ValueError("domain_threads must be between 1 and threads")
        self.timeout_s, self.threads, self.max_waiting = timeout_s, threads, max_waiting
        self.domain_threads = domain_threads or threads
        #: compiles of each cache domain that hold a thread or wait for one, and the domain's
        #: share of the threads (made with its first compile, dropped with its last)
        self._domain_load: dict[str, int] = {}
        self._domain_slots: dict[str, asyncio.Semaphore] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="guide-compile"
        )
        self._cache: OrderedDict[Key, Outcome] = OrderedDict()
        self._cache_size = cache_size
        self._inflight: dict[Key, asyncio.Task[Outcome]] = {}
        self._slots: asyncio.Semaphore | None = None  # made on the loop (first check)
        self._waiting = 0
        self._running = 0
        self._on_compile = on_compile or (lambda v: None)
        self._on_running = running or (lambda n: None)

    async def check(self, guide: Guide | None, param: str, domain: str | None = None) -> None:
        """Raise APIError naming `param` unless the grammar engine accepts `guide` (None: nothing
        to check) within the time limit. Verdicts are shared only within cache domain `domain`."""
        if guide is None:
            return
        k = key(guide, domain)
        outcome = self._cache.get(k)
        if outcome is not None:
            self._cache.move_to_end(k)
        else:
            task = self._inflight.get(k)
            if task is None:
                self._take_share(k[0])
                task = asyncio.ensure_future(self._compile(k, guide))
                self._inflight[k] = task
                task.add_done_callback(lambda _t: self._inflight.pop(k, None))
            try:  # shielded: a client leaving does not cancel the others' wait
                outcome = await asyncio.shield(task)
            except _Busy as e:
                raise APIError(
                    503,
                    f"the grammar engine is busy compiling other requests' {param} ({e}); "
                    "try again",
                    type_="service_unavailable",
                    param=param,
                    code="overloaded",
                    retry_after_s=1.0,
                ) from None
        _raise_for(outcome, guide, param, self.timeout_s)

    def _take_share(self, domain: str) -> None:
        """Count a compile against its cache domain (a team's, or its cache group's)."""
        self._domain_load[domain] = self._domain_load.get(domain, 0) + 1
        if domain not in self._domain_slots:
            self._domain_slots[domain] = asyncio.Semaphore(self.domain_threads)

    def _drop_share(self, domain: str) -> None:
        n = self._domain_load[domain] - 1
        if n:
            self._domain_load[domain] = n
        else:  # none of its compiles holds or waits for the share: it goes with them
            del self._domain_load[domain]
            del self._domain_slots[domain]

    async def _compile(self, k: Key, guide: Guide) -> Outcome:
        try:
            slots = await self._thread(k[0])
        except BaseException:
            self._drop_share(k[0])  # it never reached a thread: its share is free at once
            raise
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        fut = loop.run_in_executor(self._pool, _verdict, guide)
        self._set_running(+1)
        fut.add_done_callback(lambda f: self._ended(slots, f, t0, guide, k[0]))
        try:
            async with asyncio.timeout(self.timeout_s):
                outcome = await asyncio.shield(fut)
        except TimeoutError:
            outcome = Outcome(Verdict.TOO_COMPLEX)
            log.warning(
                "a %s guide (%d characters) is still compiling after %g s: refused as too complex "
                "(its thread stays busy until llguidance returns)",
                guide.kind.value,
                len(guide.spec),
                self.timeout_s,
            )
        if outcome.verdict != Verdict.UNAVAILABLE:
            self._remember(k, outcome)
        return outcome

    async def _thread(self, domain: str) -> asyncio.Semaphore:
        """Wait for the domain's share and then a compile thread (bounded in waiters and in
        time); the slots it holds one of."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.threads)
        slots, mine = self._slots, self._domain_slots[domain]
        if self._waiting >= self.max_waiting and (slots.locked() or mine.locked()):
            raise _Busy(f"{self._waiting} compiles wait for a thread")
        self._waiting += 1
        shared = False
        try:
            async with asyncio.timeout(self.timeout_s):
                await mine.acquire()
                shared = True
                await slots.acquire()
        except BaseException as e:
            if shared:
                mine.release()
            if isinstance(e, TimeoutError):
                raise _Busy(f"no compile thread came free within {self.timeout_s:g} s") from None
            raise
        finally:
            self._waiting -= 1
        return slots

    def _ended(
        self,
        slots: asyncio.Semaphore,
        fut: asyncio.Future[Outcome],
        t0: float,
        guide: Guide,
        domain: str,
    ) -> None:
        """A compile's thread ended (in time or not): its slot, and its domain's share, are free
        again."""
        slots.release()
        self._domain_slots[domain].release()
        self._drop_share(domain)
        self._set_running(-1)
        dt = time.monotonic() - t0
        verdict = Verdict.INVALID if fut.cancelled() or fut.exception() else fut.result().verdict
        if dt > self.timeout_s:
            verdict = Verdict.TOO_COMPLEX
        log.info(
            "guide compiled: kind=%s, %d characters, %s in %.3f s",
            guide.kind.value,
            len(guide.spec),
            verdict.value,
            dt,
        )
        self._on_compile(verdict)

    def _set_running(self, d: int) -> None:
        self._running += d
        self._on_running(self._running)

    def _remember(self, k: Key, outcome: Outcome) -> None:
        self._cache[k] = outcome
        self._cache.move_to_end(k)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def close(self) -> None:
        """Stop taking compiles; a running one is not waited for (it cannot be interrupted)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _verdict(guide: Guide) -> Outcome:
    """On a pool thread: compile `guide` and say what the engine found."""
    try:
        why = grammar_error_uncached(guide)
    except GrammarEngineMissing as e:
        return Outcome(Verdict.UNAVAILABLE, str(e))
    return Outcome(Verdict.OK) if why is None else Outcome(Verdict.INVALID, why)


def _raise_for(outcome: Outcome, guide: Guide, param: str, timeout_s: float) -> None:
    match outcome.verdict:
        case Verdict.OK:
            return
        case Verdict.UNAVAILABLE:
            raise APIError(400, f"structured outputs are not available: {outcome.why}", param=param)
        case Verdict.TOO_COMPLEX:
            raise APIError(
                400,
                f"the {WHAT[guide.kind]} in {param} is too complex to compile within {timeout_s:g} "
                "s (simplify it: fewer optional properties, alternatives or counted repetitions)",
                param=param,
                code="guide_too_complex",
            )
        case Verdict.INVALID:
            raise APIError(
                400, f"unsupported or invalid {WHAT[guide.kind]}: {outcome.why}", param=param
            )
