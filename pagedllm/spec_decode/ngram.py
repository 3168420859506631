"""N-gram prompt lookup: the drafts are the tokens that followed the latest earlier occurrence of
the sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min).

Outputs that copy from their context (editing, quoting, code) repeat n-grams of it, so what
followed before is a good guess of what follows now, at the cost of a search, no model.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` draft tokens for ``token_ids`` (prompt + output), or [] when no n-gram of the
    suffix, for any n in [min_n, max_n], occurs earlier. Longer matches are tried first (they
    predict better); among matches of one length, the latest (the most local context)."""
    length = len(token_ids)
    if k < 1 or length < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    max_n = min(max_n, length - 1)
    # One pass for every n: the earlier positions holding the last token are the ends of the only
    # windows that can match; each end's match length grows while the tokens before it agree
    # with the suffix's. (Per n, a sliding-window compare of the whole sequence cost ~10x more:
    # this runs once per speculating sequence and step.)
    ends = np.flatnonzero(tokens[: length - 1] == tokens[-1])
    if ends.size == 0:
        return []
    matched = np.ones(ends.size, dtype=np.int64)
    for j in range(1, max_n):
        before = ends - j
        agree = (before >= 0) & (matched == j)
        agree[agree] = tokens[before[agree]] == tokens[length - 1 - j]
        if not agree.any():
            break
        matched[agree] += 1
    for n in range(max_n, min_n - 1, -1):
        hits = ends[matched >= n]
        if hits.size:
            start = int(hits[-1]) + 1
            return tokens[start : start + k].tolist()
    return []
