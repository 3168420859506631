"""vLLM's engine arguments: the common ones construct and generate, the rest fail by name."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.entrypoints.cli import build_parser
from pagedllm.vllm_args import UnsupportedEngineArgument

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
# What a vLLM script commonly passes (values pagedllm honours or that are vLLM's defaults)
VLLM_KWARGS = dict(
    dtype="float",
    seed=0,
    max_model_len=256,
    max_num_seqs=8,
    max_num_batched_tokens=256,
    block_size=16,
    enable_prefix_caching=True,
    swap_space=0.01,
    tensor_parallel_size=1,
    pipeline_parallel_size=1,
    enforce_eager=True,
    trust_remote_code=True,
    enable_chunked_prefill=True,
    kv_cache_dtype="auto",
    disable_log_stats=True,
    tokenizer_mode="auto",
    num_gpu_blocks_override=32,
    load_format="auto",  # unsupported, but vLLM's default: changes nothing
    revision=None,
    cpu_offload_gb=0,
)


def test_common_vllm_engine_args_construct_and_generate(tiny_llama):
    llm = LLM(model=tiny_llama, **VLLM_KWARGS)
    engine = llm.llm_engine
    assert engine.num_kv_blocks == 32  # num_gpu_blocks_override is num_kv_blocks
    assert engine.config.swap_space_gib == 0.01
    assert str(engine.dtype) == "torch.float32"
    assert engine.max_model_len == 256
    (out,) = llm.generate("The quick brown fox", GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].text


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(load_format="pt"), "load_format"),
        (dict(cpu_offload_gb=2), "cpu_offload_gb"),
        (dict(enable_lora=True), "enable_lora"),
        (dict(tokenizer_revision="dev"), "tokenizer_revision"),
        (dict(download_dir="/tmp/x"), "download_dir"),
    ],
)
def test_unsupported_vllm_args_are_named(kwargs, needle):
    with pytest.raises(UnsupportedEngineArgument, match=f"vLLM's engine argument {needle}"):
        EngineConfig.from_kwargs(**kwargs)


def test_pipeline_parallelism_above_one_is_not_supported_yet():
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 is not supported yet"):
        EngineConfig.from_kwargs(pipeline_parallel_size=2)


def test_tensor_parallel_size_and_executor_backend_are_accepted():
    cfg = EngineConfig.from_kwargs(tensor_parallel_size=2, distributed_executor_backend="mp")
    assert (cfg.tensor_parallel_size, cfg.distributed_executor_backend) == (2, "mp")


def test_unknown_name_is_a_type_error_with_a_hint():
    with pytest.raises(TypeError, match=r"gpu_memory_utilisation \(did you mean gpu_memory_utilization\?\)"):
        EngineConfig.from_kwargs(gpu_memory_utilisation=0.5)


def test_alias_and_field_together_are_refused():
    with pytest.raises(TypeError, match="same engine argument"):
        EngineConfig.from_kwargs(swap_space=1, swap_space_gib=2)


@pytest.mark.parametrize("spelling,dtype", [("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16")])
def test_vllm_dtype_spellings(spelling, dtype):
    assert EngineConfig(dtype=spelling).dtype == dtype


def test_kv_cache_dtype_names():
    assert EngineConfig(kv_cache_dtype="bf16").kv_cache_dtype == "bfloat16"
    assert EngineConfig(kv_cache_dtype="half").kv_cache_dtype == "float16"
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"  # vLLM's fp8 is e4m3
    assert EngineConfig(kv_cache_dtype="INT8").kv_cache_dtype == "int8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="float64")


def test_serve_flags():
    parser = build_parser(["serve"])
    args = parser.parse_args(
        ["serve", "m", "--swap-space", "2", "--enforce-eager", "--no-enable-chunked-prefill", "--load-format", "auto"]
    )
    assert (args.swap_space_gib, args.enforce_eager, args.enable_chunked_prefill) == (2.0, True, False)
    assert args.disable_log_requests is False


@pytest.mark.parametrize("argv", [["--load-format", "pt"], ["--enable-lora"], ["--cpu-offload-gb", "2"]])
def test_unsupported_serve_flag_is_named(argv, capsys):
    with pytest.raises(SystemExit):
        build_parser(["serve"]).parse_args(["serve", "m", *argv])
    assert f"vLLM's engine argument {argv[0]}" in capsys.readouterr().err


def test_gpu_memory_utilization_sizes_the_kv_cache(tiny_llama, monkeypatch):
    from pagedllm import memory_budget

    # A 1 GiB machine on which the process holds 0.75 GiB after loading: half of it is 0.5 GiB,
    # already used up; 0.8 of it leaves ~0.05 GiB for the KV cache.
    gib = 2**30
    monkeypatch.setattr(memory_budget, "host_total_bytes", lambda: gib)
    monkeypatch.setattr(memory_budget, "process_resident_bytes", lambda: 3 * gib // 4)
    monkeypatch.setattr(memory_budget, "host_available_bytes", lambda: gib)
    llm = LLM(model=tiny_llama, dtype="float32", gpu_memory_utilization=0.8)
    engine = llm.llm_engine
    per_block = _bytes_per_block(engine)
    budget = int(0.8 * gib) - 3 * gib // 4
    assert engine.num_kv_blocks == budget // per_block
    # explicit sizes win over the fraction
    llm = LLM(model=tiny_llama, dtype="float32", gpu_memory_utilization=0.8, num_kv_blocks=8)
    assert llm.llm_engine.num_kv_blocks == 8
    llm = LLM(model=tiny_llama, dtype="float32", gpu_memory_utilization=0.8, kv_cache_memory_gib=0.001)
    assert llm.llm_engine.num_kv_blocks == int(0.001 * gib) // per_block
    with pytest.raises(ValueError, match="leaves nothing for the KV cache"):
        LLM(model=tiny_llama, dtype="float32", gpu_memory_utilization=0.5)


def test_budget_is_capped_at_available_memory(monkeypatch):
    import torch

    from pagedllm import memory_budget

    monkeypatch.setattr(memory_budget, "host_total_bytes", lambda: 100 * 2**30)
    monkeypatch.setattr(memory_budget, "process_resident_bytes", lambda: 2**30)
    monkeypatch.setattr(memory_budget, "host_available_bytes", lambda: 3 * 2**30)
    assert memory_budget.kv_cache_budget_bytes(0.5, torch.device("cpu")) == 3 * 2**30
    monkeypatch.setattr(memory_budget, "host_available_bytes", lambda: 90 * 2**30)
    assert memory_budget.kv_cache_budget_bytes(0.5, torch.device("cpu")) == 49 * 2**30


def _bytes_per_block(engine) -> int:
    k, v = engine.runner.kv_caches[0]
    return len(engine.runner.kv_caches) * (k.nbytes + v.nbytes) // engine.num_kv_blocks


def test_skip_tokenizer_init(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=32, skip_tokenizer_init=True)
    assert llm.get_tokenizer() is None
    (out,) = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.generate("a text prompt", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings need the tokenizer"):
        llm.generate([5, 6], SamplingParams(stop=["x"]), use_tqdm=False)
    assert llm.llm_engine.get_num_unfinished_requests() == 0


def test_chat_template_inline_and_file(tiny_llama, tmp_path):
    inline = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=16, chat_template=inline)
    assert llm.apply_chat_template([{"role": "user", "content": "hi"}]) == "[hi]"
    path = tmp_path / "t.jinja"
    path.write_text("<{{ messages[0]['content'] }}>")
    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=16, chat_template=str(path))
    assert llm.apply_chat_template([{"role": "user", "content": "hi"}]) == "<hi>"
    with pytest.raises(ValueError, match="neither a readable file nor a Jinja template"):
        LLM(model=tiny_llama, dtype="float32", num_kv_blocks=16, chat_template=str(tmp_path / "missing.jinja"))


GEN_CONFIG = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 7, "repetition_penalty": 1.1}


@pytest.fixture(scope="module")
def model_with_generation_config(tiny_llama, tmp_path_factory) -> str:
    """The tiny model with a generation_config.json recommending sampling and 5 new tokens."""
    path = str(tmp_path_factory.mktemp("genconfig") / "model")
    shutil.copytree(tiny_llama, path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({**GEN_CONFIG, "max_new_tokens": 5, "eos_token_id": 0}, f)
    return path


def test_generation_config_auto_sets_default_sampling(model_with_generation_config):
    llm = LLM(model=model_with_generation_config, dtype="float32", num_kv_blocks=32)
    sp = llm.get_default_sampling_params()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty, sp.max_tokens) == (0.6, 0.9, 7, 1.1, 5)
    assert not sp.greedy
    (out,) = llm.generate([5, 6, 7], use_tqdm=False)  # no SamplingParams: the model's defaults
    assert len(out.outputs[0].token_ids) <= 5


def test_generation_config_vllm_keeps_vllm_defaults(model_with_generation_config):
    llm = LLM(model=model_with_generation_config, dtype="float32", num_kv_blocks=32, generation_config="vllm")
    assert llm.get_default_sampling_params() == SamplingParams()


def test_generation_config_folder(tiny_llama, model_with_generation_config, tmp_path):
    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=32, generation_config=model_with_generation_config)
    assert llm.get_default_sampling_params().temperature == 0.6
    with pytest.raises(ValueError, match="no generation_config.json"):
        LLM(model=tiny_llama, dtype="float32", num_kv_blocks=32, generation_config=str(tmp_path))
