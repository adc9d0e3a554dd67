"""Incremental detokenization of one sequence, safe for multi-byte UTF-8, with stop strings.

Decoding uses the prefix_offset / read_offset scheme: the new text is
decode(ids[prefix_offset:]) minus decode(ids[prefix_offset:read_offset]), so that tokenizers
whose decoding of a token depends on its neighbours (leading-space markers, byte-level pieces)
give the same text as a full decode. Text that ends in U+FFFD (an incomplete UTF-8 sequence) is
held back until more tokens complete it, or until `flush()` at the end.
"""

from __future__ import annotations

from typing import Any

# Prompt tokens kept as left context for the first decoded output tokens (as in vLLM).
INITIAL_PREFIX_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns the output tokens of one sequence into text, a few tokens at a time.

    tokenizer: a HF tokenizer (PreTrainedTokenizerFast or compatible `decode`), or None
    (skip_tokenizer_init mode: all text is ""). spaces_between_special_tokens is kept for
    vLLM's API; fast tokenizers' decode, like HF's, does not insert such spaces.
    Engine order per step: add_tokens -> check_stop -> get_stream_delta.
    """

    def __init__(
        self,
        tokenizer: Any | None,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # ids[prefix_offset:] of the full sequence; earlier ids are no longer needed.
        context = list(prompt_token_ids[-INITIAL_PREFIX_TOKENS:])
        self._ids: list[int] = context
        self._read_offset = len(context)  # index in self._ids of the first undecoded token
        self._text = ""
        self._unchecked_chars = 0  # chars appended since the last check_stop
        self._streamed = 0  # chars of self._text already returned by get_stream_delta
        self._stopped = False

    @property
    def output_text(self) -> str:
        """All text decoded so far (truncated at a stop string once one is found)."""
        return self._text

    @property
    def stopped(self) -> bool:
        """Whether check_stop has found a stop string."""
        return self._stopped

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Append new output tokens; return the text they complete ("" if none yet)."""
        if self.tokenizer is None or self._stopped or not new_token_ids:
            return ""
        self._ids.extend(new_token_ids)
        return self._decode_pending(final=False)

    def flush(self) -> str:
        """Emit any held-back text (e.g. a trailing incomplete UTF-8 sequence) at the end."""
        if self.tokenizer is None or self._stopped or self._read_offset == len(self._ids):
            return ""
        return self._decode_pending(final=True)

    def _decode_pending(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[: self._read_offset])
        full_text = self._decode(self._ids)
        if len(full_text) <= len(prefix_text):
            if final:  # nothing visible (e.g. skipped special tokens); drop the pending ids
                self._ids = self._ids[self._read_offset :]
                self._read_offset = 0
            return ""
        if full_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""  # wait for the rest of the character
        new_text = full_text[len(prefix_text) :]
        # Advance: the decoded tokens become the left context of the next ones.
        self._ids = self._ids[self._read_offset :]
        self._read_offset = len(self._ids)
        self._text += new_text
        self._unchecked_chars += len(new_text)
        return new_text

    def check_stop(self, stop: list[str], include_stop_str_in_output: bool) -> str | None:
        """Look for a stop string in the text added since the last call.

        Only the last (new chars + len(stop) - 1) chars are searched, since older text was
        checked before. On a match (the earliest one), output_text is cut at the stop string's
        start, or its end with include_stop_str_in_output, and the stop string is returned.
        """
        new_chars = self._unchecked_chars
        self._unchecked_chars = 0
        if not stop or new_chars == 0 or self._stopped:
            return None
        best: tuple[int, str] | None = None
        for stop_str in stop:
            start = max(len(self._text) - new_chars - len(stop_str) + 1, 0)
            index = self._text.find(stop_str, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop_str)
        if best is None:
            return None
        index, stop_str = best
        end = index + len(stop_str) if include_stop_str_in_output else index
        self._text = self._text[:end]
        self._streamed = min(self._streamed, end)
        self._stopped = True
        return stop_str

    def get_stream_delta(self, finished: bool, stop: list[str]) -> str:
        """Text not yet streamed, holding back a suffix that could start a stop string.

        When finished, held-back UTF-8 bytes are flushed first (unless a stop string ended the
        sequence) and everything left is returned, so the deltas add up to output_text.
        """
        if finished:
            self.flush()
            hold = 0
        else:
            hold = _stop_prefix_suffix_len(self._text, stop, self._streamed)
        end = len(self._text) - hold
        if end <= self._streamed:
            return ""
        delta = self._text[self._streamed : end]
        self._streamed = end
        return delta


def _stop_prefix_suffix_len(text: str, stop: list[str], floor: int) -> int:
    """Length of the longest suffix of text (not reaching before `floor`) that is a prefix of
    some stop string."""
    longest = 0
    available = len(text) - floor
    for stop_str in stop:
        for length in range(min(len(stop_str), available), longest, -1):
            if text.endswith(stop_str[:length]):
                longest = length
                break
    return longest
