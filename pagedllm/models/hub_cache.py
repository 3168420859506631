"""Find a model named as on the Hugging Face hub (``org/name``) in the local hub cache, offline.

pagedllm never downloads: a name resolves only when ``huggingface-cli download`` (or transformers,
or vLLM) already put it in the cache. The cache layout, as huggingface_hub writes it::

    <cache>/models--{org}--{name}/refs/{revision}     a file holding a commit hash
    <cache>/models--{org}--{name}/snapshots/{hash}/   the files of that commit (links into blobs/)

Written here rather than through huggingface_hub: its cache constants are read once at import
(a later $HF_HUB_CACHE is missed) and only plain file reads are certain never to reach the network.
"""

from __future__ import annotations

import os
import re

# A hub repo id: "name" or "org/name" (letters, digits, '-', '_', '.'), as huggingface_hub validates.
_REPO_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+$")
DEFAULT_REVISION = "main"


def hub_cache_dir() -> str:
    """The hub cache: $HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
    ~/.cache/huggingface/hub (huggingface_hub's own order)."""
    cache = os.environ.get("HF_HUB_CACHE")
    if not cache:
        home = os.environ.get("HF_HOME")
        if not home:
            xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
            home = os.path.join(xdg, "huggingface")
        cache = os.path.join(home, "hub")
    return os.path.abspath(os.path.expanduser(cache))


def is_repo_id(model: str) -> bool:
    """Whether ``model`` reads as a hub repo id (and so may be looked up in the cache)."""
    return bool(_REPO_ID.match(model)) and not any(part in (".", "..") for part in model.split("/"))


def _not_cached(model: str, revision: str, looked: str, why: str) -> ValueError:
    return ValueError(
        f"Model {model!r} (revision {revision!r}) is neither a local folder nor in the local Hugging Face "
        f"cache: {why} "
        f"(looked in {looked}). pagedllm never downloads models: on a machine with internet run "
        f"`huggingface-cli download {model}` and copy its cache here (or point $HF_HUB_CACHE at it), "
        f"or pass a local folder or .gguf path instead."
    )


def _snapshot_dir(model: str, revision: str) -> str:
    repo_dir = os.path.join(hub_cache_dir(), "models--" + model.replace("/", "--"))
    if not os.path.isdir(repo_dir):
        raise _not_cached(model, revision, hub_cache_dir(), "no such repository")
    snapshots = os.path.join(repo_dir, "snapshots")
    ref = os.path.join(repo_dir, "refs", revision)
    commit = revision  # a commit hash names its snapshot folder directly
    if os.path.isfile(ref):
        with open(ref) as f:
            commit = f.read().strip()
    # The commit must name a folder directly under snapshots/ (a revision of ".." or "a/../b" must
    # not reach outside it).
    if not commit or os.sep in commit or "/" in commit or commit in (".", ".."):
        raise _not_cached(model, revision, repo_dir, "no such revision")
    snapshot = os.path.join(snapshots, commit)
    if not os.path.isdir(snapshot):
        why = "its ref points to a missing snapshot" if os.path.isfile(ref) else "no such revision"
        raise _not_cached(model, revision, repo_dir, why)
    return snapshot


def _gguf_files(snapshot: str) -> list[str]:
    found = []
    for root, _dirs, files in os.walk(snapshot):
        found += [os.path.join(root, f) for f in files if f.lower().endswith(".gguf")]
    return sorted(found)


def resolve_hub_model(model: str, revision: str | None = None) -> str:
    """The cached snapshot folder of repo ``model`` at ``revision`` (a ref such as "main" or a commit
    hash; None: "main"), or for a repo holding only one .gguf file (no config.json) that file.

    Raises ValueError saying where it looked and how to get the model when it is not cached, or
    when a GGUF repo holds several .gguf files (which one must be given as a path).
    """
    revision = revision or DEFAULT_REVISION
    snapshot = _snapshot_dir(model, revision)
    if os.path.isfile(os.path.join(snapshot, "config.json")):
        return snapshot
    ggufs = _gguf_files(snapshot)
    if len(ggufs) == 1:
        return ggufs[0]
    if len(ggufs) > 1:
        listed = "\n  ".join(ggufs)
        raise ValueError(
            f"Model {model!r} (revision {revision!r}) is a GGUF repository with {len(ggufs)} .gguf files "
            f"in the local Hugging Face cache; pass the path of the one to run:\n  {listed}"
        )
    raise _not_cached(model, revision, snapshot, "the snapshot has neither config.json nor a .gguf file")
