"""A request's output text: incremental detokenization and stop strings (host only).

`TextState.push(token)` decodes one more output token the way vLLM's incremental detokenizer
does: the text of a short window of recent output tokens is compared with that window's text
before the token, and only a delta that does not end in U+FFFD is taken, so a character split
over several tokens (UTF-8 bytes of the byte tokenizer, byte-fallback pieces) is emitted whole
once its last token arrives. `finish()` flushes what is left (an incomplete character as
U+FFFD). The text is the output's alone, as `tokenizer.decode(output tokens)` gives it (HF's
`TextIteratorStreamer(skip_prompt=True)` likewise): without a stop string, the finished text
equals that decode for a tokenizer whose decoding of a sequence extends its prefixes'.

Stop strings are matched on the decoded text across token boundaries: after each token, the
text from (max stop length - 1) characters before the new delta is searched; the earliest
match ends the request (the token that completed it is the last output token) and the text is
cut at the match (`include_stop_str`: after it). Matches are looked for once at least
`min_tokens` tokens were generated, in the text of the tokens from then on (the overlap
above included). `visible()` is the text a stream may show: while stop strings could still
match, their length - 1 last characters are held back.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

REPLACEMENT = "\ufffd"


@runtime_checkable  # checkable at run time (the tests' beartype hook)
class Tokenizer(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class TextState:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), include_stop_str: bool = False):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = self.read = 0  # the window's start; the end of what was decoded into text
        self.text = ""
        self.stop = tuple(stop)
        self.include_stop_str = include_stop_str
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.stopped: str | None = None  # the stop string that matched
        self.finished = False

    def push(self, token: int, match_stops: bool = True) -> str | None:
        """Decode one more output token; returns the stop string it completed (the text is then
        cut), else None. `match_stops`: False while min_tokens is not reached."""
        if self.finished:
            return None
        self.ids.append(int(token))
        before = len(self.text)
        prefix_text = self.tokenizer.decode(self.ids[self.prefix:self.read])
        new_text = self.tokenizer.decode(self.ids[self.prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT):
            self.text += new_text[len(prefix_text):]
            self.prefix, self.read = self.read, len(self.ids)
        if match_stops and self.stop and len(self.text) > before:
            return self._match(max(0, before - self.hold))
        return None

    def _match(self, start: int) -> str | None:
        found = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not found:
            return None
        i, s = min(found, key=lambda x: (x[0], -len(x[1])))
        self.text = self.text[:i + (len(s) if self.include_stop_str else 0)]
        self.stopped = s
        self.finished = True
        return s

    def finish(self) -> None:
        """The request ended: take whatever the window still holds (an incomplete character
        decodes as U+FFFD), unless a stop string cut the text."""
        if self.finished:
            return
        self.finished = True
        prefix_text = self.tokenizer.decode(self.ids[self.prefix:self.read])
        new_text = self.tokenizer.decode(self.ids[self.prefix:])
        if len(new_text) > len(prefix_text):
            self.text += new_text[len(prefix_text):]

    def visible(self) -> str:
        """The text a stream may show now (stop strings' possible starts held back)."""
        if self.finished or not self.hold:
            return self.text
        return self.text[:max(0, len(self.text) - self.hold)]
