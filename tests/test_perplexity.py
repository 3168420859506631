"""`pagedllm bench perplexity`: llama-perplexity's windows, scored through the engine, against a
perplexity computed directly from Hugging Face logits over the same windows."""

from __future__ import annotations

import json
import math
import random
import re

import pytest
import torch

from pagedllm import LLM
from pagedllm.bench.perplexity import chunk_windows, perplexity, read_text, scored_positions, tokenize

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def hf_perplexity(model_dir: str, windows: list[list[int]]) -> float:
    """exp(mean NLL) of tokens first + 1 .. n - 1 of each window, from one HF forward per window."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            logp = torch.log_softmax(hf(torch.tensor([w])).logits[0].double(), dim=-1)
            first = len(w) // 2
            for j in range(first + 1, len(w)):
                nll -= logp[j - 1, w[j]].item()
                count += 1
    return math.exp(nll / count)


def test_windows_are_llamacpp_chunks():
    toks = list(range(100, 205))  # 105 tokens
    w = chunk_windows(toks, 10, None)
    assert len(w) == 10 and w[0] == list(range(100, 110)) and w[9] == list(range(190, 200))  # tail dropped
    wb = chunk_windows(toks, 10, 1)
    assert [x[0] for x in wb] == [1] * 10 and [x[1:] for x in wb] == [x[1:] for x in w]
    assert toks[0] == 100  # the caller's list is left alone
    assert len(chunk_windows(toks, 10, None, max_chunks=3)) == 3
    assert list(scored_positions(512)) == list(range(257, 512))  # 255 per chunk, as llama.cpp counts
    with pytest.raises(ValueError, match="at least 212"):
        chunk_windows(toks, 106, None)


@pytest.mark.parametrize(
    "bos,budget,context",
    [(None, 2048, 32), (0, 2048, 32), (None, 20, 33)],
    ids=["no-bos", "bos", "chunked-prefill-odd-context"],
)
def test_perplexity_equals_transformers(tiny_llama, bos, budget, context):
    rng = random.Random(1)
    tokens = [rng.randrange(3, 512) for _ in range(230)]
    llm = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=budget)
    res = perplexity(llm, tokens, context, bos)
    windows = chunk_windows(tokens, context, bos)
    assert res.chunks == len(windows) == 230 // context
    assert res.tokens_scored == res.chunks * (context - context // 2 - 1)
    assert res.tokens == 230 and res.add_bos == (bos is not None)
    ref = hf_perplexity(tiny_llama, windows)
    assert abs(math.log(res.ppl) - math.log(ref)) < 1e-5, (res.ppl, ref)
    assert res.nll_mean == pytest.approx(math.log(res.ppl))
    assert 0 < res.ppl_stderr < res.ppl
    assert len(res.running_ppl) == res.chunks and res.running_ppl[-1] == pytest.approx(res.ppl)


def test_tokenize_as_llamacpp(tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    text = "Paged attention <|im_start|> stores keys."
    ids, bos = tokenize(tok, text)
    assert bos is None  # this tokenizer adds no BOS
    # special-token text is plain text (llama.cpp tokenizes with parse_special=false)
    assert tok.convert_tokens_to_ids("<|im_start|>") not in ids
    assert tok.decode(ids) == text

    class AddsBos:
        bos_token_id, eos_token_id = 7, 8

        def __call__(self, text, add_special_tokens=True, **kw):
            return {"input_ids": [7] + [ord(c) for c in text]}

    assert tokenize(AddsBos(), "ab") == ([7, 97, 98], 7)

    class AddsEos(AddsBos):
        def __call__(self, text, add_special_tokens=True, **kw):
            return {"input_ids": [ord(c) for c in text] + [8]}

    with pytest.raises(ValueError, match="EOS"):
        tokenize(AddsEos(), "ab")
    p = tmp_path / "t.txt"
    p.write_bytes(b"line one\r\nline two\n\n")
    assert read_text(str(p)) == "line one\r\nline two\n"  # one trailing newline dropped, as llama.cpp's -f


def test_cli_writes_json(tiny_llama, tmp_path, capsys):
    from pagedllm.entrypoints.cli import main

    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. Paged attention stores keys in blocks.\n" * 12)
    out = tmp_path / "res" / "ppl.json"
    argv = ["bench", "perplexity", "--model", tiny_llama, "--text", str(text), "--context", "32"]
    argv += ["--dtype", "float32", "--num-kv-blocks", "64", "--output-json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    m = re.search(r"^perplexity: ([\d.]+) \((\d+) chunks of 32 tokens\)$", printed, re.M)
    assert m, printed
    res = json.loads(out.read_text())
    for key in ("model", "quantization", "context", "chunks", "tokens_scored", "ppl", "nll_mean", "seconds"):
        assert key in res
    assert res["bench"] == "perplexity" and res["model"] == tiny_llama and res["quantization"] == "none"
    assert res["context"] == 32 and res["chunks"] == int(m.group(2)) == res["tokens"] // 32 >= 2
    assert res["tokens_scored"] == res["chunks"] * 15
    assert float(m.group(1)) == pytest.approx(res["ppl"], abs=1e-4)
    assert res["nll_mean"] == pytest.approx(math.log(res["ppl"]))

    # too short a text for the context: a clear error, exit code 2
    assert main([*argv[:7], "1024", *argv[8:]]) == 2
    assert "needs at least 2048" in capsys.readouterr().err
