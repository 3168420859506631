"""Maps a Hugging Face ``architectures`` name to our implementation."""

from __future__ import annotations

from torch import nn

from pagedllm.models.gemma3 import Gemma3ForCausalLM
from pagedllm.models.gpt2 import GPT2LMHeadModel
from pagedllm.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from pagedllm.models.opt import OPTForCausalLM
from pagedllm.models.phi3 import Phi3ForCausalLM

# Every class here provides pagedllm.models.interface.CausalLM.
_MODELS: dict[str, type[nn.Module]] = {
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(hf_config) -> type[nn.Module]:
    archs = getattr(hf_config, "architectures", None) or []
    for a in archs:
        if a in _MODELS:
            return _MODELS[a]
    raise ValueError(f"Model architecture(s) {archs} not supported. Supported: {', '.join(supported_architectures())}.")
