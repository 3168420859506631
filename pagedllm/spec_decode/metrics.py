"""The speculative-decoding counters on /metrics, under vLLM's names: drafts (verifying passes
with drafts), draft tokens, accepted tokens, and accepted tokens per draft position (a
``position`` label, 0 for the first draft). Only an engine that speculates has them."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric

_COUNTERS = [
    ("spec_decode_num_drafts", "Number of spec decoding drafts."),
    ("spec_decode_num_draft_tokens", "Number of draft tokens."),
    ("spec_decode_num_accepted_tokens", "Number of accepted tokens."),
]
_PER_POS = "spec_decode_num_accepted_tokens_per_pos"


def spec_decode_metrics(prefix: str, labels: list[str], series: list[tuple[list[str], dict]]) -> Iterator[Metric]:
    """The families for ``series`` ((label values, engine stats) pairs), if any engine speculates."""
    series = [(values, stats) for values, stats in series if "spec_decode_num_drafts" in stats]
    if not series:
        return
    for name, doc in _COUNTERS:
        c = CounterMetricFamily(prefix + name, doc, labels=labels)
        for values, stats in series:
            c.add_metric(values, float(stats[name]))
        yield c
    per_pos = CounterMetricFamily(
        prefix + _PER_POS, "Accepted tokens per draft position.", labels=[*labels, "position"]
    )
    for values, stats in series:
        for pos, n in enumerate(stats[_PER_POS]):
            per_pos.add_metric([*values, str(pos)], float(n))
    yield per_pos
