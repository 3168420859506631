"""Speculative decoding: n-gram prompt lookup or a draft model proposes tokens, one target pass
verifies them.

config.py parses vLLM's ``speculative_config``; ngram.py proposes drafts from a sequence's own
tokens; draft_model.py runs a draft model beside the target (draft_load.py loads and checks it);
planner.py decides, per sequence and step, whether and how much to speculate (and keeps the
counters); verify.py accepts the drafts the target model agrees with (greedy), rejection.py
samples over them keeping the target's distribution (temperature > 0); metrics.py exports the
counters.
"""
