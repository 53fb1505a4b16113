"""Prompt-lookup drafts for greedy decoding (n-gram speculation, as vLLM's `ngram` method).

When few sequences decode, a step is bound by reading the weights, not by arithmetic, and an
extra row costs a fraction of the step. A greedy sequence whose last tokens appeared
earlier in its prompt or output guesses that what followed then follows again, and verifies those
guesses in the same step as its next token: one row per guess, each a decode row at its position.
Its greedy token at every row is then computed as a plain decode would compute it, so the
completion is the same; a guess stands only if every token before it was the model's own choice.
"""

# A step verifies at most this many guesses, those of the sequences with the most tokens left
# (they set when a batch completes). On a CPU a guess row at a long context costs its arithmetic
# (the C++ attention reads a sequence's KV once for all its rows): W1's tail on SmolLM2 (12 rows
# at ~700 tokens, ~42 ms a step) paid ~1.4 ms a row before that sharing, ~1 ms after, so guesses
# for sequences that finish early anyway only slow its steps: filling steps with guesses up to 32
# rows took W1 as long as none (72.7 s against 73.2 s, 754 steps against 923); 4 a step took 72.7
# and 73.8 s against 78.4 and 76.3 s without (alternating, 779 steps); with the sharing, 8 and 16
# a step took 103.8 and 107.1 s against 89.7 s for 4 (764 and 758 steps against 779).
DRAFT_ROWS = 4
# Only in steps of fewer decode rows than this: larger ones are bound by their arithmetic.
DRAFT_BELOW_ROWS = 32
# The n-gram sizes looked up, longest first: a match of one token guesses too often wrong.
NGRAM_SIZES = (4, 3, 2)


class NgramIndex:
    """Where each n-gram of a sequence's tokens last ended, built as its tokens grow."""

    def __init__(self):
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> the position after its last end
        self._indexed = 0  # n-grams ending at or before this position are in _ends

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest suffix
        of `tokens` (NGRAM_SIZES) seen before; none if no suffix was."""
        # Index n-grams ending before the last token: the suffix itself must be found earlier.
        last = len(tokens) - 1
        for end in range(self._indexed + 1, last + 1):
            for n in NGRAM_SIZES:
                if end >= n:
                    self._ends[tuple(tokens[end - n:end])] = end
        self._indexed = max(self._indexed, last)
        for n in NGRAM_SIZES:
            end = self._ends.get(tuple(tokens[-n:])) if len(tokens) > n else None
            if end is not None:
                return tokens[end:end + limit]
        return []


def accepted(verified: list, draft: list[int]) -> list:
    """The tokens a drafted sequence takes: `verified` holds its token at its own row and at each
    draft row; a draft row's token counts only if every draft token before it was verified."""
    taken = 1
    while taken <= len(draft) and verified[taken - 1].token_id == draft[taken - 1]:
        taken += 1
    return verified[:taken]
