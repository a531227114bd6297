"""Incremental detokenization of one request's generated tokens, with stop-string handling."""

from __future__ import annotations

from typing import Any

from mmserve.sampling_params import SamplingParams

# Prompt tokens decoded together with the first generated tokens, so that the first delta is decoded in
# context (tokenizers whose decoding of a token depends on its neighbours).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turn a stream of token ids into a stream of text deltas, stopping at the first stop string.

    `add` returns only text that is final: an incomplete multi-byte character and any trailing text that
    could still become the start of a stop string are held back until disambiguated. `finish` releases what
    is held back. EOS and stop token ids are the engine's business; this class handles text only.

    Attributes:
        text: all text released so far (never contains a stop string unless `include_stop_str_in_output`).
        stopped: True once a stop string matched; later `add` calls return "".
        matched_stop: the stop string that matched, or None.
    """

    def __init__(
        self, tokenizer: Any, params: SamplingParams, prompt_token_ids: list[int] | None = None
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops: tuple[str, ...] = tuple(params.stop)
        self._include_stop = params.include_stop_str_in_output
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]) if prompt_token_ids else []
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(self._ids[: self._read_offset])
        self._output = ""  # all decoded generated text, including what is held back
        self.text = ""
        self.stopped = False
        self.matched_stop: str | None = None
        self._finished = False

    def add(self, token_id: int) -> str:
        """Append one generated token and return the newly released text (possibly "")."""
        if self.stopped or self._finished:
            return ""
        self._ids.append(token_id)
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            # Nothing visible yet (a special token being skipped) or an incomplete UTF-8 sequence.
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return self._append(delta, final=False)

    def finish(self) -> str:
        """Release everything held back (including an incomplete trailing character) and return it."""
        if self.stopped or self._finished:
            return ""
        self._finished = True
        new_text = self._decode(self._ids[self._prefix_offset :])
        delta = new_text[len(self._prefix_text) :] if len(new_text) > len(self._prefix_text) else ""
        return self._append(delta, final=True)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _append(self, delta: str, final: bool) -> str:
        """Add decoded text to the output, check stop strings and release what is safe to release."""
        old_len = len(self._output)
        self._output += delta
        match = self._find_stop(old_len)
        if match is not None:
            pos, stop = match
            self.stopped = True
            self.matched_stop = stop
            end = pos + len(stop) if self._include_stop else pos
            return self._release(self._output[:end])
        if final:
            return self._release(self._output)
        hold = self._stop_prefix_len()
        return self._release(self._output[: len(self._output) - hold])

    def _find_stop(self, old_len: int) -> tuple[int, str] | None:
        """Earliest stop string occurrence that ends in text added after `old_len`."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            # Occurrences ending at or before old_len were already checked on earlier calls.
            pos = self._output.find(stop, max(0, old_len - len(stop) + 1))
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        return best

    def _stop_prefix_len(self) -> int:
        """Length of the longest output suffix that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._output)), longest, -1):
                if self._output.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _release(self, releasable: str) -> str:
        # Released text only grows; a shorter `releasable` (more held back now) releases nothing.
        if len(releasable) <= len(self.text):
            return ""
        delta = releasable[len(self.text) :]
        self.text = releasable
        return delta
