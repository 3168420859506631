"""Hub names (``org/name``) resolve in a local Hugging Face cache, offline: a fake cache in the
layout huggingface_hub writes (refs/, snapshots/ linking into blobs/), holding tiny checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import socket

import pytest
from gguf_models import write_gguf
from tiny_models import build_model

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.engine_args import engine_kwargs
from pagedllm.models.resolve import gguf_source, resolve_model_path

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO = "tiny-org/tiny-llama"
MAIN = "a" * 40
DEV = "b" * 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPTS = ["The quick brown fox", "Paged attention stores"]
SMALL = dict(dtype="float32", num_kv_blocks=32, max_model_len=256)


def _snapshot(cache, repo: str, commit: str, refs: tuple[str, ...] = ("main",)) -> str:
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo_dir / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo_dir / "refs" / ref).write_text(commit)  # huggingface_hub writes no newline
    return str(snap)


def _as_blobs(snap: str) -> None:
    """Moves the snapshot's files into blobs/ and links them back, as the real cache stores them."""
    blobs = os.path.join(snap, "..", "..", "blobs")
    os.makedirs(blobs, exist_ok=True)
    for name in os.listdir(snap):
        blob = os.path.join(blobs, f"{os.path.basename(snap)[:8]}-{name}")
        shutil.move(os.path.join(snap, name), blob)
        os.symlink(os.path.relpath(blob, snap), os.path.join(snap, name))


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> dict[str, str]:
    """A hub cache at <root>/hub (so $HF_HOME=<root> finds it too) and its snapshot folders."""
    root = tmp_path_factory.mktemp("hf_home")
    cache = root / "hub"
    paths = {"root": str(root), "cache": str(cache)}
    paths["main"] = build_model("llama", _snapshot(cache, REPO, MAIN))
    _as_blobs(paths["main"])
    paths["dev"] = build_model("llama", _snapshot(cache, REPO, DEV, refs=("dev",)), seed=1)

    odd = build_model("llama", _snapshot(cache, "tiny-org/unsupported", MAIN))
    with open(os.path.join(odd, "config.json")) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["FooBarForCausalLM"]
    with open(os.path.join(odd, "config.json"), "w") as f:
        json.dump(cfg, f)

    paths["gguf"] = write_gguf(
        paths["main"], os.path.join(_snapshot(cache, "tiny-org/one-gguf", MAIN), "m.Q8_0.gguf"), {}
    )
    two = _snapshot(cache, "tiny-org/two-gguf", MAIN)
    for name in ("m.Q8_0.gguf", "m.Q4_0.gguf"):
        shutil.copy(paths["gguf"], os.path.join(two, name))

    (cache / "models--tiny-org--broken" / "refs").mkdir(parents=True)
    (cache / "models--tiny-org--broken" / "refs" / "main").write_text("c" * 40)  # no such snapshot
    with open(os.path.join(_snapshot(cache, "tiny-org/readme-only", MAIN), "README.md"), "w") as f:
        f.write("no weights\n")
    return paths


@pytest.fixture
def cache_env(hub, monkeypatch, tmp_path) -> dict[str, str]:
    monkeypatch.setenv("HF_HUB_CACHE", hub["cache"])
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # offline must not depend on it
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "converted"))  # GGUF conversions
    return hub


@pytest.fixture
def no_network(monkeypatch) -> list[object]:
    """Every socket connect raises and is recorded (so a caller swallowing the error still fails)."""
    attempts: list[object] = []

    def refuse(self, address):
        attempts.append(address)
        raise OSError(f"network access attempted: {address!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    with pytest.raises(OSError, match="network access attempted"):
        socket.create_connection(("127.0.0.1", 9))
    attempts.clear()
    return attempts


def _greedy(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_resolves_name_revision_name_and_commit_hash(cache_env, no_network):
    assert resolve_model_path(REPO) == cache_env["main"]
    assert resolve_model_path(REPO, revision="main") == cache_env["main"]
    assert resolve_model_path(REPO, revision="dev") == cache_env["dev"]
    assert resolve_model_path(REPO, revision=DEV) == cache_env["dev"]  # a snapshot, no ref needed
    assert gguf_source(REPO) is None  # an HF folder
    with pytest.raises(ValueError, match="revision 'v9'.*no such revision"):
        resolve_model_path(REPO, revision="v9")
    with pytest.raises(ValueError, match="no such revision"):
        resolve_model_path(REPO, revision="../../models--tiny-org--unsupported/snapshots/" + MAIN)
    assert no_network == []


def test_hub_name_generates_as_its_snapshot_path(cache_env, no_network):
    by_name = LLM(REPO, tokenizer=REPO, **SMALL)
    assert by_name.llm_engine.model_path == cache_env["main"]
    by_path = LLM(cache_env["main"], **SMALL)
    tokens = _greedy(by_name)
    assert tokens == _greedy(by_path) and all(tokens)
    # The other revision is another checkpoint (seed 1): revision reaches the engine.
    dev = LLM(REPO, revision="dev", **SMALL)
    assert dev.llm_engine.model_path == cache_env["dev"]
    assert _greedy(dev) != tokens
    assert no_network == []


@pytest.mark.parametrize(
    "repo,why",
    [
        ("tiny-org/absent", "no such repository"),
        ("tiny-org/broken", "missing snapshot"),
        ("tiny-org/readme-only", "neither config.json nor a .gguf"),
    ],
)
def test_not_cached_is_a_clear_error(cache_env, no_network, repo, why):
    with pytest.raises(ValueError) as err:
        LLM(repo, **SMALL)
    msg = str(err.value)
    for needle in (repr(repo), "nor in the local Hugging Face cache", why, cache_env["cache"]):
        assert needle in msg
    assert f"huggingface-cli download {repo}" in msg and "local folder" in msg
    assert no_network == []


def test_hf_home_then_home_cache_fallbacks(hub, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", hub["root"])
    assert resolve_model_path(REPO) == hub["main"]
    monkeypatch.delenv("HF_HOME")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ValueError, match="looked in " + str(tmp_path / ".cache" / "huggingface" / "hub")):
        resolve_model_path(REPO)


def test_unsupported_architecture_gives_the_registry_error(cache_env):
    with pytest.raises(ValueError, match=r"\['FooBarForCausalLM'\] not supported\. Supported: .*LlamaForCausalLM"):
        LLM("tiny-org/unsupported", **SMALL)


def test_single_gguf_repo_runs_that_file(cache_env, no_network):
    name = "tiny-org/one-gguf"
    snap_gguf = os.path.join(cache_env["cache"], "models--tiny-org--one-gguf", "snapshots", MAIN, "m.Q8_0.gguf")
    assert gguf_source(name) == snap_gguf
    folder = resolve_model_path(name)
    assert os.path.isfile(os.path.join(folder, "config.json")) and folder.startswith(os.environ["PAGEDLLM_CACHE_DIR"])
    # quantized in its blocks (the GGUF path) on the reference backend: no kernel build
    gguf = dict(SMALL, quantization="gguf", attention_backend="torch")
    by_name = LLM(name, **gguf)
    assert type(by_name.llm_engine.model).__name__ == type(LLM(snap_gguf, **gguf).llm_engine.model).__name__
    assert _greedy(by_name) == _greedy(LLM(snap_gguf, **gguf))
    assert no_network == []


def test_several_ggufs_ask_for_the_file(cache_env):
    with pytest.raises(ValueError, match=r"2 \.gguf files.*pass the path") as err:
        resolve_model_path("tiny-org/two-gguf")
    assert "m.Q4_0.gguf" in str(err.value) and "m.Q8_0.gguf" in str(err.value)
    assert gguf_source("tiny-org/two-gguf") is None


def test_serve_takes_a_hub_name_and_revision():
    args = build_parser(["serve"]).parse_args(["serve", REPO, "--revision", "dev"])
    assert args.model_tag == REPO and args.served_model_name is None  # served as REPO: run_server
    kwargs = engine_kwargs(args)
    assert kwargs["revision"] == "dev"
    assert EngineConfig.from_kwargs(**dict(kwargs, model=REPO)).revision == "dev"
