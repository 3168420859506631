"""Default sampling parameters from a model's generation_config.json (vLLM's ``--generation-config``).

As in vLLM, the fields a model's creator recommends become the defaults of requests that leave
them unset: ``LLM.generate`` without SamplingParams uses them, and the OpenAI server fills omitted
request fields from them (``max_new_tokens`` caps ``max_tokens``). Only values that differ from
Hugging Face's GenerationConfig defaults count (``to_diff_dict``), so a file spelling out
``top_k: 50`` changes nothing, exactly as in vLLM.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("pagedllm")

# generation_config.json name -> SamplingParams field
_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def load_generation_defaults(source: str, model_path: str) -> dict[str, object]:
    """SamplingParams defaults per ``source``: "auto" (the model folder's generation_config.json),
    "vllm" (none: SamplingParams' own) or a folder holding a generation_config.json."""
    if source == "vllm":
        return {}
    folder = model_path if source == "auto" else os.path.expanduser(source)
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        if source != "auto":
            raise ValueError(f"generation_config={source!r}: no generation_config.json in that folder.")
        return {}
    from transformers import GenerationConfig

    try:
        diff = GenerationConfig.from_pretrained(folder).to_diff_dict()
    except Exception as e:  # transformers raises several types for a malformed file
        raise ValueError(f"Could not read {path}: {e}") from e
    defaults = {ours: diff[theirs] for theirs, ours in _FIELDS.items() if diff.get(theirs) is not None}
    if defaults:
        logger.info(
            "default sampling parameters from the model's generation config: %s (--generation-config vllm "
            "to use vLLM's defaults instead)",
            defaults,
        )
    return defaults
