"""/tokenize and /detokenize, vLLM's request and response shapes.

/tokenize takes a ``prompt`` or chat ``messages`` (rendered by the same chat template as
/v1/chat/completions) and answers ``{count, max_model_len, tokens, token_strs}``; ``token_strs``
(the vocabulary entries) is null unless ``return_token_strs``. /detokenize answers ``{prompt}``.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat


class OpenAIServingTokenization:
    """Shares the chat endpoint's tokenizer, tokenizer thread and template rendering."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def tokenize(self, req: TokenizeRequest) -> dict:
        chat = self.chat
        chat.check_model(req.model)
        if req.messages is not None:
            if len(req.messages) > chat.limits.max_messages:
                raise APIError(
                    f"messages has {len(req.messages)} messages; at most {chat.limits.max_messages} are allowed.",
                    param="messages",
                )
            add_special = bool(req.add_special_tokens)  # vLLM: off for messages unless asked
            rendered = await chat.in_tokenizer_thread(
                chat.render, req.messages, req.add_generation_prompt is not False, req.chat_template_kwargs, add_special
            )
            tokens = rendered["prompt_token_ids"]
        else:
            add_special = req.add_special_tokens is not False
            tokens = await chat.in_tokenizer_thread(chat.encode, req.prompt, add_special)
        token_strs = None
        if req.return_token_strs:
            token_strs = await chat.in_tokenizer_thread(chat.tokenizer.convert_ids_to_tokens, tokens)
        return {"count": len(tokens), "max_model_len": chat.max_model_len, "tokens": tokens, "token_strs": token_strs}

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        chat = self.chat
        chat.check_model(req.model)
        vocab = chat.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"Token ids out of range [0, {vocab}): {bad[:5]}.", param="tokens")
        text = await chat.in_tokenizer_thread(chat.tokenizer.decode, req.tokens)
        return {"prompt": text}
