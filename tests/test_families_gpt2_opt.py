"""GPT-2 and OPT: greedy output equals transformers on both paths; checkpoints load in every
naming transformers and the hub use; options we do not compute, and contexts past the learned
positions, are refused."""

from __future__ import annotations

import glob

import pytest
import torch
from safetensors import safe_open
from test_cpu_kernels import assert_bf16_tokens_follow
from test_fidelity import assert_greedy_matches_transformers
from tiny_models import build_model

from pagedllm import LLM, SamplingParams
from pagedllm.layers import LinearMethods
from pagedllm.models.cpu_linear import PackedLinear
from pagedllm.models.interface import CausalLM

FAMILIES = ["gpt2", "opt", "opt_postln"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(tiny_model_dirs, family, backend):
    """ "auto": the compiled decode attention kernel through AttentionMetadata; "torch": the
    reference path (what PAGEDLLM_NO_KERNELS=1 gives)."""
    import pagedllm.kernels

    if backend == "auto" and pagedllm.kernels.load_cpu_kernels() is None:
        pytest.skip("CPU kernels not built here")
    outs = assert_greedy_matches_transformers(tiny_model_dirs[family], attention_backend=backend)
    llm = LLM(model=tiny_model_dirs[family], dtype="float32", num_kv_blocks=8, attention_backend=backend)
    assert (llm.llm_engine.runner.decode_kernel is not None) == (backend == "auto")
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    # the tiny models must not be degenerate, or matching would prove little
    assert len({t for o in outs for t in o.outputs[0].token_ids}) > 20


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("gpt2", {"tie_word_embeddings": False, "activation_function": "gelu", "n_inner": 96}),
        ("opt", {"enable_bias": False, "layer_norm_elementwise_affine": False, "_remove_final_layer_norm": True}),
        ("opt", {"tie_word_embeddings": False, "activation_function": "gelu"}),
    ],
)
def test_config_variants_match_transformers(tmp_path, family, overrides):
    """The options the tiny families leave at their defaults: an untied head, other activations
    and MLP widths, no biases, LayerNorms without weights, OPT's removed final LayerNorm."""
    model_dir = build_model(family, str(tmp_path / family), config_overrides=overrides)
    outs = assert_greedy_matches_transformers(model_dir, attention_backend="torch")
    assert len({t for o in outs for t in o.outputs[0].token_ids}) > 20


def test_models_keep_the_contract(tiny_model_dirs):
    for family in ["llama", *FAMILIES]:
        model = LLM(model=tiny_model_dirs[family], dtype="float32", num_kv_blocks=8).llm_engine.model
        assert isinstance(model, CausalLM), family


def test_structure_follows_the_config(tiny_model_dirs):
    """OPT's final LayerNorm exists only pre-LN; project_in / project_out only where the word
    embeddings are narrower than the hidden size; GPT-2 always has ln_f."""
    models = {f: LLM(model=tiny_model_dirs[f], dtype="float32", num_kv_blocks=8).llm_engine.model for f in FAMILIES}
    assert models["gpt2"].final_norm is not None and models["gpt2"].project_in is None
    assert models["opt"].final_norm is not None and models["opt"].project_in is None
    post = models["opt_postln"]
    assert post.final_norm is None and not post.layers[0].pre_norm
    assert post.project_in.local.weight.shape == (64, 32) and post.project_out.local.weight.shape == (32, 64)


def _checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    (path,) = glob.glob(f"{model_dir}/*.safetensors")
    with safe_open(path, framework="pt") as fh:
        return {name: fh.get_tensor(name) for name in fh.keys()}


def _loaded(cls, model_dir: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's weights after loading ``tensors`` and building its float32 GEMMs."""
    from transformers import AutoConfig

    model = cls(AutoConfig.from_pretrained(model_dir), 64)
    model.load_weights(tensors.items())
    model.finish_weights(LinearMethods(torch.float32))
    return model.state_dict()


def test_gpt2_loads_the_hub_layout(tiny_model_dirs):
    """The hub's GPT-2 checkpoints name tensors without "transformer." and carry each layer's
    causal-mask buffers (attn.bias, attn.masked_bias): both load to the same weights."""
    from pagedllm.models.gpt2 import GPT2LMHeadModel

    d = tiny_model_dirs["gpt2"]
    ours = _checkpoint(d)
    hub = {name.removeprefix("transformer."): t for name, t in ours.items()}
    for i in range(2):
        hub[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 512, 512))
        hub[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    a, b = _loaded(GPT2LMHeadModel, d, ours), _loaded(GPT2LMHeadModel, d, hub)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # Conv1D [in, out] became nn.Linear [out, in]
    assert torch.equal(a["layers.0.self_attn.qkv_proj.local.weight"], ours["transformer.h.0.attn.c_attn.weight"].t())


def test_opt_loads_the_older_layout(tiny_model_dirs):
    """Older OPT checkpoints name tensors "decoder.*" (no "model."); they load the same."""
    from pagedllm.models.opt import OPTForCausalLM

    d = tiny_model_dirs["opt_postln"]
    ours = _checkpoint(d)
    old = {name.removeprefix("model."): t for name, t in ours.items()}
    a, b = _loaded(OPTForCausalLM, d, ours), _loaded(OPTForCausalLM, d, old)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_unknown_and_missing_weights_are_refused(tiny_model_dirs):
    from pagedllm.models.opt import OPTForCausalLM

    d = tiny_model_dirs["opt"]
    tensors = _checkpoint(d)
    with pytest.raises(ValueError, match="unexpected weight"):
        _loaded(OPTForCausalLM, d, {**tensors, "model.decoder.layers.0.extra.weight": torch.zeros(1)})
    del tensors["model.decoder.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match="missing weights"):
        _loaded(OPTForCausalLM, d, tensors)


@pytest.mark.parametrize(
    "family, option, value",
    [
        ("gpt2", "scale_attn_by_inverse_layer_idx", True),
        ("gpt2", "reorder_and_upcast_attn", True),
        ("gpt2", "scale_attn_weights", False),
        ("gpt2", "add_cross_attention", True),
        ("gpt2", "activation_function", "swish"),
        ("opt", "activation_function", "silu"),
    ],
)
def test_options_not_implemented_are_refused(tiny_model_dirs, family, option, value):
    from transformers import AutoConfig

    from pagedllm.models.registry import get_model_class

    cfg = AutoConfig.from_pretrained(tiny_model_dirs[family])
    setattr(cfg, option, value)
    with pytest.raises(NotImplementedError, match=option), torch.device("meta"):
        get_model_class(cfg)(cfg, 64)


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_context_is_bounded_by_the_learned_positions(tiny_model_dirs, family):
    from transformers import AutoConfig

    from pagedllm.models.registry import get_model_class

    llm = LLM(model=tiny_model_dirs[family], dtype="float32", num_kv_blocks=8)
    assert llm.llm_engine.max_model_len == 512  # the config's max_position_embeddings
    with pytest.raises(ValueError, match="max_model_len=513"):
        LLM(model=tiny_model_dirs[family], dtype="float32", num_kv_blocks=8, max_model_len=513)
    cfg = AutoConfig.from_pretrained(tiny_model_dirs[family])
    with pytest.raises(ValueError, match="learned positions"), torch.device("meta"):
        get_model_class(cfg)(cfg, 513)


HEAD_DIM_64 = {"n_embd": 128, "n_head": 2}  # the compiled prefill attention kernel's head size


@pytest.mark.parametrize("family, overrides", [*((f, None) for f in FAMILIES), ("gpt2", HEAD_DIM_64)])
def test_bf16_packed_forward_picks_reference_tokens(tiny_model_dirs, tmp_path, family, overrides):
    """bf16 with the kernels (weights packed for their GEMMs, the LM head's argmax kernel on
    greedy steps, the decode attention kernel, the prefill one at head_dim 64 where it is built)
    follows the reference path token for token, except after a position where the reference's
    top two logprobs are a near-tie."""
    import pagedllm.kernels

    kernels = pagedllm.kernels.load_cpu_kernels()
    if kernels is None:
        pytest.skip("CPU kernels not built here")
    model_dir = tiny_model_dirs[family]
    if overrides is not None:
        model_dir = build_model(family, str(tmp_path), config_overrides=overrides)
    prompts = [[1, 5, 9, 200, 3], list(range(10, 60)), [7] * 23]
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
    outs = {}
    for backend in ("auto", "torch"):
        llm = LLM(model=model_dir, dtype="bfloat16", num_kv_blocks=64, attention_backend=backend)
        # packed only where the packed GEMM was built (AVX512-BF16); elsewhere bf16 runs plain torch
        # matmuls on the kernel path, which must follow the reference just the same
        assert isinstance(llm.llm_engine.model.lm_head.local, PackedLinear) == kernels.packed_gemm_available()
        if backend == "auto" and overrides is HEAD_DIM_64 and kernels.prefill_attention_available(64, 16):
            assert llm.llm_engine.runner.prefill_kernel is not None
        requests = [{"prompt_token_ids": p} for p in prompts]
        outs[backend] = [o.outputs[0] for o in llm.generate(requests, with_logprobs, use_tqdm=False)]
        # greedy without logprobs: argmax_only steps, where the packed head skips the logits
        greedy = llm.generate(requests, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in greedy] == [o.token_ids for o in outs[backend]]
    assert_bf16_tokens_follow(outs["auto"], outs["torch"])
