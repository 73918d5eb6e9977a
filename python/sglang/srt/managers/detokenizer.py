"""Incremental detokenisation and stop-string trimming, shared by streaming and non-streaming.

Two rules keep what a client sees consistent:

* Text only grows by whole characters. A byte-level tokenizer splits one UTF-8 character over
  several tokens; decoding a prefix of them yields U+FFFD. We decode a small window of tokens and
  hold back the new text while it ends in U+FFFD (flushed as is when the request finishes).
* Every chunk streamed is a prefix of the final text. With stop strings, the final text ends
  before the first stop string, so while streaming we hold back any tail that could still become
  a stop string. Hence the concatenation of the streamed deltas equals the non-streamed text.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Decodes a growing token list into append-only text.

    `prefix_offset..read_offset` is the window already turned into text; decoding it again
    alongside the new tokens and subtracting its own decoding gives exactly the new characters,
    also for tokenizers that treat the start of a sequence specially (SentencePiece spaces).
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def decode_prefix(self, n: int) -> str:
        """The text of the first n tokens, decoded whole."""
        return self._decode(self.ids[:n])

    def add(self, new_ids: Sequence[int], final: bool = False) -> str:
        """Append tokens; return the characters that became final (possibly "")."""
        self.ids.extend(int(t) for t in new_ids)
        if self.read_offset == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text):
            return ""  # e.g. a skipped special token: nothing visible yet
        if not final and full_text.endswith(REPLACEMENT_CHAR):
            return ""  # an incomplete character: wait for its remaining bytes
        delta = full_text[len(prefix_text) :]
        self.text += delta
        # The tokens just decoded become the context window of the next decode.
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return delta

    def flush(self) -> str:
        """At the end of the request: emit whatever is pending, even an incomplete character."""
        if self.read_offset == len(self.ids):
            return ""
        return self.add([], final=True)


def longest_partial_stop(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


def first_stop(text: str, stops: Sequence[str], protected: int = 0) -> Optional[tuple[int, str]]:
    """(position, stop string) of the first stop string in `text` that ends past its first
    `protected` characters (the text of `min_new_tokens` tokens, where stop strings do not count;
    one may begin there and end after it), or None."""
    best: Optional[tuple[int, str]] = None
    for stop in stops:
        pos = text.find(stop, max(0, protected - len(stop) + 1))
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, stop)
    return best


def visible_text(text: str, stops: Sequence[str], finished: bool, trim_stop: bool = True,
                 protected: int = 0, keep_stop: bool = False) -> str:
    """The part of `text` a client may see: cut at the first stop string (one ending within the
    first `protected` characters does not count), or just after it with `keep_stop` (vLLM's
    include_stop_str_in_output), and while running, without a tail that might still grow into
    one. `trim_stop` False (SGLang's no_stop_trim): all of it."""
    if not stops or not trim_stop:
        return text
    found = first_stop(text, stops, protected)
    if found is not None:
        return text[:found[0] + len(found[1])] if keep_stop else text[:found[0]]
    if finished:
        return text
    hold = longest_partial_stop(text, stops)
    return text[: len(text) - hold] if hold else text


def find_stop_string(tail_text: str, stops: Sequence[str], protected: int = 0) -> Optional[str]:
    """The stop string in `tail_text` that occurs first, ending past its first `protected`
    characters, if any (scheduler side)."""
    found = first_stop(tail_text, stops, protected)
    return found[1] if found else None


def _byte_level_alphabet() -> dict[str, int]:
    """The character a byte-level BPE vocabulary (GPT-2's convention, used by Qwen and Llama 3)
    writes each byte as: printable Latin-1 bytes stand for themselves, every other byte for the
    next code point from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_alphabet()


def token_bytes(text: str, piece: Optional[str]) -> list[int]:
    """The UTF-8 bytes a token stands for (OpenAI's `bytes` of a logprob entry). `text` is the
    token decoded alone; where that is a replacement character (a token holding part of a UTF-8
    character), the raw bytes come from its vocabulary `piece`: SentencePiece's byte fallback
    `<0xNN>`, or a byte-level BPE string. Otherwise the text's own bytes."""
    if REPLACEMENT_CHAR in text and piece:
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return [int(piece[3:5], 16)]
            except ValueError:
                pass
        if all(c in _BYTE_LEVEL for c in piece):
            return [_BYTE_LEVEL[c] for c in piece]
    return list(text.encode("utf-8"))
