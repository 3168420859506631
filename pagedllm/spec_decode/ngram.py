"""N-gram prompt lookup: the drafts are the tokens that followed the latest earlier occurrence of
the sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min).

Outputs that copy from their context (editing, quoting, code) repeat n-grams of it, so what
followed before is a good guess of what follows now, at the cost of a search, no model.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` draft tokens for ``token_ids`` (prompt + output), or [] when no n-gram of the
    suffix, for any n in [min_n, max_n], occurs earlier. Longer matches are tried first (they
    predict better); among matches of one length, the latest (the most local context)."""
    length = len(token_ids)
    if k < 1 or length < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # Windows starting before the suffix itself: those at 0 .. length - n - 1.
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []
