"""The response-size budget of a request's prompt-derived content, checked before it runs.

A response repeats its prompts in two ways that cost the server little to compute but much to
build, hold and send: echo (the prompt's text, and with logprobs its tokens' logprobs, in every
one of the n choices: OpenAI's legacy format) and vLLM's prompt_logprobs (once per prompt). A
prompt's logprobs come out of one prefill step for thousands of positions at once, so a 23 KB
request (4,000 prompt ids, n=32, prompt_logprobs=20) asked for a response of 174 MiB. Their size
is estimated here from the prompts' token counts and refused above ServerLimits.
max_prompt_response_bytes with a 400 naming the field that costs most.

Generated tokens' logprobs are not counted: each position costs a decode step of its own, and
their number is bounded by max_tokens and --max-request-tokens.

The sizes per entry are those of the JSON the endpoints write, for a typical token of about five
characters (measured: the 174 MiB response above averages 68 bytes per prompt_logprobs entry).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.entrypoints.openai.errors import APIError

# completions logprobs, per position: the token, its logprob and text_offset
POSITION_BYTES = 40
# completions logprobs, per top_logprobs entry: "token": logprob
TOP_ENTRY_BYTES = 32
# vLLM's prompt_logprobs, per entry: "id": {"logprob", "rank", "decoded_token"}
PROMPT_LOGPROB_ENTRY_BYTES = 72


@dataclass(frozen=True)
class PromptResponse:
    """What a request's response repeats of its prompts."""

    prompt_lens: list[int]  # tokens of each prompt
    prompt_chars: list[int]  # characters of each prompt's echoed text (0 without echo)
    choices_per_prompt: int  # n
    echo_top: int | None = None  # echo with logprobs: top entries per echoed position
    prompt_top: int | None = None  # prompt_logprobs: top entries per position

    def parts(self) -> dict[str, int]:
        """Estimated bytes by the request field that asks for them."""
        n = self.choices_per_prompt
        tokens = sum(self.prompt_lens)
        out = {"echo": n * sum(self.prompt_chars)}
        if self.echo_top is not None:
            # the echoed prompt's logprobs, in every choice; the chosen token may be beside the top
            out["logprobs"] = n * tokens * (POSITION_BYTES + (self.echo_top + 1) * TOP_ENTRY_BYTES)
        if self.prompt_top is not None:
            out["prompt_logprobs"] = tokens * (self.prompt_top + 1) * PROMPT_LOGPROB_ENTRY_BYTES
        return out


def check_prompt_response(shape: PromptResponse, max_bytes: int) -> None:
    """Raises APIError(400) naming the costliest field when the estimate exceeds ``max_bytes``."""
    parts = shape.parts()
    total = sum(parts.values())
    if total <= max_bytes:
        return
    field = max(parts, key=parts.__getitem__)
    mib = 2**20
    raise APIError(
        f"The response would repeat its {sum(shape.prompt_lens)} prompt tokens in about {total / mib:.1f} MiB "
        f"({field} costs most, with n={shape.choices_per_prompt}); at most {max_bytes / mib:.1f} MiB are "
        "allowed (--max-prompt-response-bytes). Ask for fewer prompt logprobs, fewer choices or a "
        "shorter prompt.",
        param=field,
    )
