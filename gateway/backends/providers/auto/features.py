"""Hand-designed features of a chat request for the `model: "auto"` complexity classifier.

Pure Python (no numpy, no torch) and a few passes over the text (word-set lookups and substring
counts, two small regexes), so a request costs tens of microseconds. Each feature is a number that a
person can read and argue with: how long the request is, how deep the conversation, whether it
carries code, maths, requests for proof or design, multi-step structure, constraints, or only small
talk. Keyword lists hold a few stems in the languages the evaluation set covers (en, fr, de, es, pt,
it, ru, zh, ja, ar, hi); they are cues, not a translation of the whole vocabulary.

Bounded work: the cues read at most the last `SCAN_CHARS` characters of the last user message
(and its first few hundred for how it opens), so any message costs about the same; a message
that fits is read whole, as the weights were fit.

Invariant: `FEATURE_NAMES` and the order of `features()` are what weights.json was fit with;
changing either means re-running `python -m gateway.backends.providers.auto.fit`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any


class _Cue:
    """Whole words (matched against the lower-cased word tokens) and fragments (counted as
    substrings: stems, phrases, and scripts written without spaces)."""

    __slots__ = ("fragments", "words")

    def __init__(self, words: str, fragments: tuple[str, ...] = ()) -> None:
        self.words = frozenset(words.split())
        self.fragments = fragments

    def count(self, tokens: list[str], lower: str) -> int:
        n = sum(1 for t in tokens if t in self.words)
        return n + sum(lower.count(f) for f in self.fragments)


_GREETING_START = (
    "hi",
    "hello",
    "hey",
    "thanks",
    "thank you",
    "good morning",
    "good evening",
    "good night",
    "bonjour",
    "hola",
    "hallo",
    "ciao",
    "guten",
    "bom dia",
    "привет",
    "こんにちは",
    "你好",
    "¡hola",
)
_LOOKUP_START = (
    "what",
    "who",
    "when",
    "where",
    "which",
    "how many",
    "how much",
    "is ",
    "are ",
    "can ",
    "do ",
    "does ",
    "quel",
    "qui ",
    "quand",
    "wie viele",
    "welche",
    "wer ",
    "¿cuál",
    "¿cuánto",
    "¿quién",
    "qual",
    "quanto",
    "cosa",
    "какая",
    "какой",
    "сколько",
    "¿cómo se dice",
)
_LOOKUP = _Cue(
    "define definition synonym antonym plural spell translate",
    (
        "how do you say",
        "meaning of",
        "stand for",
        "past tense",
        "是什么",
        "多少",
        "何と言い",
        "ما هي",
        "क्या है",
        "traduis",
        "traduce",
        "переведи",
        "翻译",
    ),
)
_PROOF = _Cue(
    "prove proof derive derivation theorem lemma induction irrational undecidable justify rigorous "
    "démontrez démontre beweise dimostra demuestra",
    ("show that", "докаж", "证明", "証明", "推导"),
)
_DESIGN = _Cue(
    "design architect architecture scale scalable scalability distributed throughput latency "
    "consistency consistent failover failure failures idempotency idempotent race deadlock "
    "deadlocks concurrency concurrent multi-tenant tradeoffs tradeoff conçois entwirf diseña "
    "compromis lock-free thread-safe",
    ("replicat", "migrat", "exactly once", "per second", "trade-off", "设计", "設計"),
)
_ANALYSE = _Cue(
    "analyse analyze analysis critically evaluate assess implication implications risk risks "
    "recommend recommendation hypotheses hypothesis causal confounders robustness steelman "
    "steelmans analysiere analise analizza",
    ("strongest argument", "分析", "анализ"),
)
_EXPLAIN = _Cue(
    "explain why difference differences compare describe summarize summarise tldr explique erkläre "
    "explica spiega объясни warum pourquoi почему",
    (
        "how does",
        "how do",
        "how can",
        "how should",
        "pros and cons",
        "tl;dr",
        "por qué",
        "解释",
        "説明",
        "为什么",
    ),
)
_TASK = _Cue(
    "write draft create implement build plan suggest make rewrite convert list schreibe rédige "
    "escribe scrivi",
    ("give me", "请写", "作成", "書いて"),
)
_MATH = _Cue(
    "solve integral derivative probability equation matrix eigenvalues eigenvectors limit expected "
    "recurrence markov lagrange differential series compute calculate calcula percent mean median "
    "formula interest prime sqrt",
    ("%", "square root", "lim_", "o("),
)
_MATH_SYMBOLS = re.compile(r"[0-9]\s*[-+*/^=]\s*[0-9a-z(]|\^|√|∫|∑|→|≤|≥")
_CODE_WORDS = _Cue(
    "python javascript typescript java sql rust go c++ c# kotlin bash regex docker dockerfile git "
    "function query api json http css class bug error exception async await goroutine goroutines "
    "kafka postgres postgresql kubernetes react",
    ("regular expression",),
)
_CODE_SYNTAX = re.compile(
    r"```|`[^`\n]+`|\bdef \w+\(|\bfunc \w+\(|[{};]$|=>|->|::|#include|\w\(\)", re.MULTILINE
)
_MULTISTEP = _Cue(
    "first firstly then finally next include including cover covering also each every all",
    ("step 1", "step 2", "after that", "as well as", "with sections", "\n1.", "\n2.", "\n- "),
)
_CONSTRAINT = _Cue(
    "must without exactly ensure guarantee guarantees handle never within budget keep survives",
    ("at most", "at least", "edge case", "o(", " time complexity"),
)
_TOKEN = re.compile(r"[\w+#-]+")
#: characters of the last user message the cues read (its end: what it asks is usually last)
SCAN_CHARS = 8192
#: characters of its start that a greeting or a lookup's opening word is looked for in
_HEAD_CHARS = 256
_SENTENCE = re.compile(r"[.!?。！？]+(\s|$)")

FEATURE_NAMES = (
    "log_chars_last",
    "log_chars_total",
    "log_words_last",
    "turns",
    "sentences",
    "questions",
    "greeting",
    "lookup",
    "proof",
    "design",
    "analyse",
    "explain",
    "task",
    "math",
    "math_symbols",
    "code_words",
    "code_syntax",
    "multistep",
    "constraints",
    "non_ascii",
    "newlines",
    "words_per_sentence",
)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            p.get("text", "")
            for p in content
            if isinstance(p, Mapping) and isinstance(p.get("text"), str)
        )
    return ""


def features(messages: Sequence[Mapping[str, Any]]) -> list[float]:
    """The feature vector of a chat request (OpenAI `messages`), in `FEATURE_NAMES` order."""
    users = [
        _text(m.get("content"))
        for m in messages
        if isinstance(m, Mapping) and m.get("role") == "user"
    ]
    whole = users[-1] if users else ""
    total = sum(len(_text(m.get("content"))) for m in messages if isinstance(m, Mapping))
    # The cues read the message's last SCAN_CHARS only: a 4 MiB message would otherwise cost
    # seconds of the event loop; its length is still exact, its word count scaled up.
    last = whole[-SCAN_CHARS:]
    words = len(last.split()) or (len(last) // 2)  # CJK text has no spaces: count ~2 chars a word
    words = words * len(whole) // max(1, len(last))
    sentences = max(1, len(_SENTENCE.findall(last)))
    non_ascii = sum(1 for ch in last if ord(ch) > 127) / max(1, len(last))

    lower = last.lower()
    tokens = _TOKEN.findall(lower)
    head = whole[:_HEAD_CHARS].lower().lstrip()

    def cue(c: _Cue, cap: float = 6.0) -> float:
        return min(cap, float(c.count(tokens, lower)))

    return [
        math.log1p(len(whole)),
        math.log1p(total),
        math.log1p(words),
        float(min(len(users), 8)),
        float(min(sentences, 12)),
        float(min(last.count("?") + last.count("？"), 6)),
        1.0 if head.startswith(_GREETING_START) else 0.0,
        1.0 if head.startswith(_LOOKUP_START) or _LOOKUP.count(tokens, lower) else 0.0,
        cue(_PROOF),
        cue(_DESIGN),
        cue(_ANALYSE),
        cue(_EXPLAIN),
        cue(_TASK),
        cue(_MATH),
        min(6.0, float(len(_MATH_SYMBOLS.findall(lower)))),
        cue(_CODE_WORDS),
        min(10.0, float(len(_CODE_SYNTAX.findall(last)))),
        cue(_MULTISTEP, 10.0),
        cue(_CONSTRAINT),
        non_ascii,
        float(min(last.count("\n"), 30)) / 10,
        min(words / sentences, 60.0) / 10,
    ]
