"""The ``chat_template`` engine argument (vLLM's ``--chat-template``): a file path or the template itself."""

from __future__ import annotations

import os

# Characters a template has and a file name hardly ever does (vLLM tells them apart the same way).
_TEMPLATE_CHARS = "{}\n"


def load_chat_template(value: str) -> str:
    """The template text: the file's contents when ``value`` names a file, else ``value`` itself
    when it looks like a Jinja template. A value that looks like a path but names no file raises
    ValueError rather than becoming a template that prints the path."""
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    if any(c in value for c in _TEMPLATE_CHARS):
        return value
    raise ValueError(f"chat_template={value!r} is neither a readable file nor a Jinja template.")
