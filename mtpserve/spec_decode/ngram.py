"""N-gram drafting (prompt lookup decoding): the drafter that needs no model.

The last n tokens of a request (n from `prompt_lookup_max` down to `prompt_lookup_min`) are looked up in its
own earlier tokens, prompt and output; the k tokens that followed their most recent earlier occurrence are the
drafts. Code, quotes and edits repeat their context, so drafts are often right and cost nothing to make.
Drafts are one-hot (p_draft = 1 on the drafted token), verified by the same path as MTP's greedy drafts, so
the output stays exactly the target model's. A request with no match verifies nothing that step.
"""
import numpy as np

from mtpserve.step import MAIN


def find_continuation(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int] | None:
    """The k tokens after the most recent earlier occurrence of tokens' last n tokens, for the largest n in
    [min_n, max_n] that has one with k tokens after it; None if none does."""
    seq = np.asarray(tokens)
    last = len(seq) - 1
    # candidate occurrences end where the last token recurs with k known tokens after it (they may overlap the
    # suffix itself); then each is extended backwards while it keeps matching, up to max_n tokens
    ends = np.flatnonzero(seq[:max(last + 1 - k, 0)] == seq[last])
    if len(ends) == 0:
        return None
    length = np.ones(len(ends), dtype=np.int64)
    for i in range(1, max_n):
        growing = (length == i) & (ends >= i)
        growing[growing] = seq[ends[growing] - i] == seq[last - i]
        if not growing.any():
            break
        length += growing
    best = int(length.max())
    if best < min_n:
        return None
    end = int(ends[np.flatnonzero(length == best)[-1]])
    return seq[end + 1:end + 1 + k].tolist()


class NgramProposer:
    """Prompt lookup: no model, no KV cache; a request whose context has no match goes without drafts."""
    fuses_with_verification = False

    def __init__(self, spec, **unused):
        self.k, self.max_n, self.min_n = spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min

    @classmethod
    def check(cls, model_config, spec) -> None:
        pass

    @classmethod
    def num_kv_caches(cls, model_config, spec) -> int:
        return 0

    @classmethod
    def lookahead_slots(cls, spec) -> int:
        return 0

    def num_passes(self, scheduled) -> int:
        return 0

    def min_last_chunk(self) -> int:
        return 1

    def graph_shapes(self) -> list[tuple[str, int]]:
        return [(MAIN, 1)]   # a request without a match decodes one token

    def propose(self, scheduled, hidden, offsets, new_tokens) -> list[tuple]:
        """Per request, (next drafts, None): a continuation for one that sampled this step and whose context
        repeats, else None."""
        return [(find_continuation(s.req.all_token_ids + new, self.k, self.max_n, self.min_n) if s.samples else None,
                 None) for s, new in zip(scheduled, new_tokens)]
