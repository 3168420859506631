"""The stored responses of /v1/responses: what ``GET /v1/responses/{id}`` returns and what
``previous_response_id`` continues. In memory, least recently used first out.

Bounded twice: by count (``--responses-store-size``) and by the characters the entries hold
(MAX_STORE_CHARS), since each entry keeps its whole conversation: a client chaining long turns
could otherwise fill the host's memory within the count. A response whose chain was evicted can
no longer be continued (404), as with OpenAI once a stored response expires.

Only the event loop touches the store: no lock.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_STORE_SIZE = 1000
MAX_STORE_CHARS = 256 * 2**20


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as returned
    conversation: list[dict[str, Any]]  # chat messages: the inputs so far and this output, no instructions
    chars: int  # what it holds, for the store's character bound


def _conversation_chars(messages: list[dict[str, Any]]) -> int:
    total = 0
    for m in messages:
        total += len(m.get("content") or "")
        for call in m.get("tool_calls") or []:
            total += len(call["function"]["name"]) + len(call["function"]["arguments"])
    return total


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_STORE_SIZE, max_chars: int = MAX_STORE_CHARS) -> None:
        if max_responses < 0:
            raise ValueError(f"the response store size must be >= 0, got {max_responses}")
        self.max_responses = max_responses
        self.max_chars = max_chars
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Stores a response, evicting the least recently used ones over either bound (a store
        of size 0 keeps nothing)."""
        if self.max_responses == 0:
            return
        chars = len(json.dumps(response, ensure_ascii=False)) + _conversation_chars(conversation)
        self.delete(response_id)
        self._entries[response_id] = StoredResponse(response, conversation, chars)
        self._chars += chars
        # The newest entry stays even alone over max_chars: it was just promised to the client.
        while len(self._entries) > 1 and (len(self._entries) > self.max_responses or self._chars > self.max_chars):
            _, old = self._entries.popitem(last=False)
            self._chars -= old.chars

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._chars -= entry.chars
        return True
