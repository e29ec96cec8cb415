"""Text in and out of the tokenizer, shared by every entry point: chat-template encoding (one way, whatever
the transformers version returns) and streaming detokenisation (whole characters only, never past a stop
string), for the CLI's printer, the OpenAI stream and the web page's source-tagged stream."""

from __future__ import annotations

import sys
from typing import Any


def as_id_list(encoded: Any) -> list[int]:
    """Input ids as a flat list[int] from whatever a tokenizer returned.

    transformers 5's `apply_chat_template(tokenize=True)` returns a BatchEncoding, older versions a list;
    tensors and batch-of-one nesting also occur.
    """
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], list):
        if len(encoded) != 1:
            raise ValueError("expected one sequence of token ids, got a batch")
        encoded = encoded[0]
    return [int(t) for t in encoded]


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of a conversation through the model's chat template, with the generation prompt."""
    if not has_chat_template(tokenizer):
        raise ValueError("the model's tokenizer has no chat template")
    return as_id_list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def encode_prompt(tokenizer: Any, text: str, chat: bool = True) -> list[int]:
    """Token ids of a user message: the chat template with a generation prompt where the tokenizer has one
    (and `chat`), else the plain text."""
    if chat and has_chat_template(tokenizer):
        return encode_chat(tokenizer, [{"role": "user", "content": text}])
    return as_id_list(tokenizer(text)["input_ids"])


class Detokenizer:
    """Incremental text from token blocks, as a stream should show it.

    A multi-byte character split across tokens is held back until complete. With stop strings, text that
    could be the start of one is held back too, and nothing from a stop string on is ever sent (OpenAI
    leaves the stop string out of the output).
    """

    def __init__(self, tokenizer: Any, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.tokens: list[int] = []
        self.sent = 0

    def push(self, block: list[int]) -> str:
        self.tokens += block
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        hits = [text.find(s) for s in self.stop if s in text]
        safe = min(hits) if hits else len(text) - self.hold
        return self._emit(text, safe)

    def finish(self, final_text: str) -> str:
        """The rest of the final text (the engine cuts it at a stop string)."""
        return self._emit(final_text, len(final_text))

    def _emit(self, text: str, upto: int) -> str:
        if upto <= self.sent:
            return ""
        new, self.sent = text[self.sent: upto], upto
        return new


class TextPrinter:
    """Prints a generation to stdout as token blocks arrive (the CLI's stream)."""

    def __init__(self, tokenizer: Any):
        self.detok = Detokenizer(tokenizer)

    def push(self, block: list[int]) -> None:
        sys.stdout.write(self.detok.push(block))
        sys.stdout.flush()

    def finish(self, final_text: str) -> None:
        """Print what is left; if a stop string cut the text, nothing past it is printed."""
        sys.stdout.write(self.detok.finish(final_text) + "\n")
        sys.stdout.flush()


class SourcedText:
    """The Detokenizer's text deltas, plus each delta split into per-token pieces tagged with a source."""

    def __init__(self, tokenizer: Any, stop: list[str] | None = None):
        self.detok = Detokenizer(tokenizer, stop)
        self.tokenizer = tokenizer
        self.ends: list[int] = []      # per token: where its text ends in the decoded text so far
        self.sources: list[str] = []   # per token

    def push(self, block: list[int], sources: list[str]) -> tuple[str, list[dict[str, str]]]:
        """Feed one committed block and its per-token sources; returns (delta, pieces of the delta)."""
        start = len(self.detok.tokens)
        sent = self.detok.sent
        delta = self.detok.push(block)
        tokens = self.detok.tokens
        for j in range(start, len(tokens)):
            text = self.tokenizer.decode(tokens[: j + 1], skip_special_tokens=True).rstrip("\ufffd")
            self.ends.append(max(len(text), self.ends[-1] if self.ends else 0))
        self.sources += list(sources) + ["bonus"] * (len(block) - len(sources))
        return delta, self._pieces(sent, delta)

    def finish(self, final_text: str) -> tuple[str, list[dict[str, str]]]:
        sent = self.detok.sent
        rest = self.detok.finish(final_text)
        return rest, self._pieces(sent, rest)

    def _pieces(self, offset: int, delta: str) -> list[dict[str, str]]:
        """`delta` (the text from `offset` on) cut at token boundaries; text past the last boundary (never
        expected) goes to the last token."""
        pieces: list[dict[str, str]] = []
        pos, end = offset, offset + len(delta)
        for j, token_end in enumerate(self.ends):
            if pos >= end:
                break
            if token_end <= pos:
                continue
            upto = end if j == len(self.ends) - 1 else min(token_end, end)
            pieces.append({"text": delta[pos - offset: upto - offset], "source": self.sources[j]})
            pos = upto
        if pos < end:
            pieces.append({"text": delta[pos - offset:], "source": self.sources[-1] if self.sources else "bonus"})
        return pieces
