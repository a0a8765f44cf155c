"""Incremental detokenisation of one generated row, with stop strings.

    s = TextStream(tokenizer, stop_strings=("\\n\\n",))
    for tok in tokens:
      delta = s.push(tok)      # text that is final now ('' while held back)
      if s.stopped: break
    s.text                     # the row's text, cut before the first stop string

The text is the tokenizer's decode of all ids so far (byte-level BPE pieces that split a UTF-8
character decode to U+FFFD until the rest arrives). `push` releases only text that can no
longer change: a trailing U+FFFD and a suffix that may be the start of a stop string are held
back. A stop string ends the row as soon as the decoded text contains it; `text` is cut before
it (the stop string is not part of the output).
"""
from __future__ import annotations

from typing import Sequence


class TextStream:
  def __init__(self, tokenizer, stop_strings: Sequence[str] = ()):
    self.tokenizer = tokenizer
    self.stop_strings = tuple(stop_strings)
    self.ids: list[int] = []
    self.text = ""           # full text so far (cut at a stop string once stopped)
    self.stopped = False     # a stop string was found
    self._released = 0       # chars of `text` handed out by push

  def push(self, token: int) -> str:
    """Adds one id; returns the newly final text (possibly '')."""
    if self.stopped:
      raise ValueError("TextStream.push after a stop string ended the row.")
    self.ids.append(int(token))
    text = self.tokenizer.decode(self.ids)
    # Search only where a stop string can newly appear: it must end in text changed since the
    # last release (decode may rewrite a held-back tail, never released text).
    cut = None
    for s in self.stop_strings:
      i = text.find(s, max(0, self._released - len(s) + 1))
      if i >= 0 and (cut is None or i < cut):
        cut = i
    if cut is not None:
      self.stopped = True
      self.text = text[:cut]
      return self._release(len(self.text))
    self.text = text
    final = len(text)
    while final > self._released and text[final - 1] == "\ufffd":
      final -= 1  # an incomplete UTF-8 character: wait for its remaining bytes
    hold = 0  # the longest suffix that may still grow into a stop string
    for s in self.stop_strings:
      for k in range(min(len(s) - 1, final - self._released), hold, -1):
        if text[final - k:final] == s[:k]:
          hold = k
          break
    return self._release(final - hold)

  def flush(self) -> str:
    """At the end of the row: the text still held back."""
    return self._release(len(self.text))

  def _release(self, upto: int) -> str:
    upto = max(upto, self._released)
    out = self.text[self._released:upto]
    self._released = upto
    return out
