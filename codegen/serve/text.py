"""The text of one choice as its tokens arrive: incremental detokenisation and `stop` strings.

`Detokenizer` decodes only a short window per token (the tokens since the last text it gave out, after the
tokens before them for context, as TGI and vLLM do), never the whole sequence again, and gives no text while the
window ends inside a UTF-8 character. `ChoiceText` adds the request's stop strings, matched on the decoded text:
the text up to the first stop string is the answer (the stop string is not returned), and while streaming it holds
back the last few characters that could still begin a stop string.
"""

from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self._prefix = 0  # window start: context only
        self._read = 0  # tokens before this have been given out as text
        self.sent = ""

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def add(self, token: int) -> str:
        self.tokens.append(token)
        return self._step(final=False)

    def rest(self) -> str:
        return self._step(final=True) if self._read < len(self.tokens) else ""

    def _step(self, final: bool) -> str:
        before = self._decode(self.tokens[self._prefix:self._read])
        now = self._decode(self.tokens[self._prefix:])
        if len(now) > len(before) and (final or not now.endswith("\ufffd")):
            delta = now[len(before):]
            self._prefix, self._read = self._read, len(self.tokens)
            self.sent += delta
            return delta
        if final:
            self._prefix = self._read = len(self.tokens)
        return ""


class ChoiceText:
    """One choice's text: `add(token)` -> the text that may be sent now; `stopped` once a stop string appeared."""

    def __init__(self, tokenizer, stop: list[str], hold_back: bool = True) -> None:
        self.detok = Detokenizer(tokenizer)
        self.stop = list(stop)
        self._hold = max((len(s) for s in self.stop), default=1) - 1 if hold_back else 0
        self.text = ""
        self._released = 0
        self.stopped = False

    @property
    def tokens(self) -> list[int]:
        return self.detok.tokens

    def add(self, token: int) -> str:
        if self.stopped:
            return ""
        return self._extend(self.detok.add(token), final=False)

    def finish(self) -> str:
        """The text still held (the end of the sequence)."""
        if self.stopped:
            return ""
        return self._extend(self.detok.rest(), final=True)

    def _extend(self, delta: str, final: bool) -> str:
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += delta
        if self.stop:
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                self.stopped = True
                final = True
        end = len(self.text) if final else max(self._released, len(self.text) - self._hold)
        out = self.text[self._released:end]
        self._released = end
        return out
