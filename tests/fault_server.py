"""`pagedllm serve` with faults injected into the model runner, for test_server_faults.py.

PAGEDLLM_TEST_FAIL_TOKEN=ID: a step raises RuntimeError when a prompt holding token ID is in it.
PAGEDLLM_TEST_CRASH_TOKEN=ID: such a step raises a BaseException instead, which kills the engine thread.
PAGEDLLM_TEST_FAIL_FILE=PATH: while PATH exists, every step that runs anything raises.
PAGEDLLM_TEST_FAIL_TOP_LOGPROBS=K: formatting the logprobs of a response asking for K top logprobs
raises (a bug of the serving layer, after a stream's 200 went out).
"""

from __future__ import annotations

import os
import sys

from pagedllm.entrypoints.cli import main
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.runner.model_runner import ModelRunner


class InjectedCrash(BaseException):
    pass


def _has_prompt_token(sched, token: int) -> bool:
    return any(token in s.token_ids[: s.num_prompt_tokens] for s in sched.new_seqs)


_real_execute = ModelRunner.execute


def execute(self, sched):
    fail = os.environ.get("PAGEDLLM_TEST_FAIL_TOKEN")
    if fail is not None and _has_prompt_token(sched, int(fail)):
        raise RuntimeError("secret internal detail of the injected fault")
    crash = os.environ.get("PAGEDLLM_TEST_CRASH_TOKEN")
    if crash is not None and _has_prompt_token(sched, int(crash)):
        raise InjectedCrash("injected crash")
    path = os.environ.get("PAGEDLLM_TEST_FAIL_FILE")
    if path is not None and os.path.exists(path) and not sched.is_empty:
        raise RuntimeError("secret: every step fails")
    return _real_execute(self, sched)


ModelRunner.execute = execute


def _failing_logprobs(real):
    def logprobs(self, token_ids, lps, top, *rest):
        if str(top) == os.environ.get("PAGEDLLM_TEST_FAIL_TOP_LOGPROBS"):
            raise RuntimeError("secret internal detail of the injected serving fault")
        return real(self, token_ids, lps, top, *rest)

    return logprobs


OpenAIServingChat._logprobs = _failing_logprobs(OpenAIServingChat._logprobs)
OpenAIServingCompletion._logprobs = _failing_logprobs(OpenAIServingCompletion._logprobs)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
