"""A script written for vLLM's offline API runs on pagedllm with only its imports changed.

QUICKSTART below is vLLM code as its docs write it (engine arguments of a GPU script, generate,
chat, Logprob objects, prompt_logprobs, structured outputs); the test rewrites ``vllm`` to
``pagedllm`` in the import lines only and runs it in a fresh interpreter.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

QUICKSTART = textwrap.dedent(
    """
    import json
    import sys

    from vllm import LLM, SamplingParams
    from vllm.sampling_params import GuidedDecodingParams, StructuredOutputsParams

    llm = LLM(
        model=sys.argv[1],
        dtype="float32",
        gpu_memory_utilization=0.02,
        max_model_len=512,
        tensor_parallel_size=1,
        enforce_eager=True,
        swap_space=1,
        seed=0,
        max_num_seqs=16,
        enable_prefix_caching=True,
        trust_remote_code=False,
    )
    prompts = ["Hello, my name is", "The capital of France is"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12, logprobs=2, prompt_logprobs=1)
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
        assert output.prompt_logprobs[0] is None
        assert len(output.prompt_logprobs) == len(output.prompt_token_ids)
        for position in output.prompt_logprobs[1:]:
            for token_id, lp in position.items():
                assert lp.logprob <= 0 and lp.rank >= 1 and isinstance(lp.decoded_token, str)
        completion = output.outputs[0]
        assert len(completion.logprobs) == len(completion.token_ids)
        for token_id, step in zip(completion.token_ids, completion.logprobs):
            assert token_id in step and len(step) >= 2
            assert {lp.rank for t, lp in step.items() if t != token_id} <= {1, 2}
        assert completion.cumulative_logprob <= 0

    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    outputs = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=8))
    print("chat:", repr(outputs[0].outputs[0].text))

    schema = {
        "type": "object",
        "properties": {
            "brand": {"type": "string", "maxLength": 10},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        },
        "required": ["brand", "year"],
        "additionalProperties": False,
    }
    params = SamplingParams(temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=schema))
    car = json.loads(llm.generate("Generate a JSON with the brand and year of a car", params)[0].outputs[0].text)
    assert isinstance(car["brand"], str) and 1900 <= car["year"] <= 2030, car
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["Positive", "Negative"]))
    sentiment = llm.generate("Classify this sentiment: vLLM is wonderful!", params)[0].outputs[0].text
    assert sentiment in ("Positive", "Negative"), sentiment
    params = SamplingParams(max_tokens=40, guided_decoding=GuidedDecodingParams(regex=r"[a-z]{1,8}@[a-z]{1,8}\\.com"))
    email = llm.generate("Generate an email address:", params)[0].outputs[0].text
    assert email.endswith(".com") and "@" in email, email
    print("OK")
    """
)


def test_vllm_quickstart_runs_with_only_the_import_changed(tiny_llama, tmp_path):
    script = re.sub(r"^from vllm(\.|\s)", r"from pagedllm\1", QUICKSTART, flags=re.M)
    changed = [a for a, b in zip(QUICKSTART.splitlines(), script.splitlines(), strict=True) if a != b]
    assert changed == [line for line in QUICKSTART.splitlines() if line.startswith("from vllm")]
    path = tmp_path / "quickstart.py"
    path.write_text(script)
    proc = subprocess.run([sys.executable, str(path), tiny_llama], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("OK")
