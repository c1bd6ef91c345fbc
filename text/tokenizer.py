"""Tokenizer + chat template for a model directory, shared by the gateway and the nodes.

Built on `tokenizers` (the Rust tokenizer that transformers wraps) and a sandboxed Jinja2
environment configured like transformers' chat-template renderer, so it is torch-free and its
output equals `AutoTokenizer.apply_chat_template` for the same files (a test checks).

Invariants: `encode_chat` never adds special tokens beyond what the template writes (the
template owns BOS/turn markers); `eos_token_ids` is the union of the tokenizer's EOS and the
model's generation config, so generation stops where transformers' would.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _RustTokenizer

Message = Mapping[str, Any]


class ChatTemplateError(ValueError):
    """The model has no chat template, or the messages do not fit it."""


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):  # older tokenizer_config.json stores AddedToken dicts
        return value.get("content")
    return value


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


class Tokenizer:
    """Encode/decode text and render chat messages for one model directory."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        tok_file = model_dir / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        self._tok = _RustTokenizer.from_file(str(tok_file))
        cfg = _read_json(model_dir / "tokenizer_config.json")
        self.bos_token = _token_content(cfg.get("bos_token"))
        self.eos_token = _token_content(cfg.get("eos_token"))
        template_file = model_dir / "chat_template.jinja"
        self.chat_template: str | None = (
            template_file.read_text() if template_file.is_file() else cfg.get("chat_template")
        )
        eos: set[int] = set()
        if (
            self.eos_token is not None
            and (tid := self._tok.token_to_id(self.eos_token)) is not None
        ):
            eos.add(tid)
        for name in ("generation_config.json", "config.json"):
            eos.update(_ids(_read_json(model_dir / name).get("eos_token_id")))
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.special_ids: frozenset[int] = frozenset(
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        )
        self._template: jinja2.Template | None = None

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters of text one token covers: its longest piece. A
        byte-level piece has a character per byte (at least one per text character it covers),
        a SentencePiece or WordPiece piece one per character; a normalizer (NFKC composes up to
        3 characters into one) gets a margin of 4. So text longer than `n × max_token_chars`
        characters is more than n tokens, known without encoding it. Reads the vocabulary
        once (a few hundred ms for 150k pieces)."""
        longest = max(len(p) for p in self._tok.get_vocab(with_added_tokens=True))
        return max(1, longest) * (4 if self._tok.normalizer is not None else 1)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def _compiled(self) -> jinja2.Template:
        if self._template is None:
            if not self.chat_template:
                raise ChatTemplateError("this model has no chat template; use /v1/completions")
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
            )
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
                x, ensure_ascii=False, indent=indent
            )
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        return self._template

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        try:
            return self._compiled().render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e

    def encode_chat(
        self, messages: Sequence[Message], add_generation_prompt: bool = True
    ) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)
