"""Bytes of weights one batch-1 decode step reads from a GGUF file: every tensor once, except the
token embedding when the file has its own output head (then a step reads one embedding row).

    python3 weight_bytes.py FILE.gguf      -> JSON {"file", "bytes_per_token", "tensor_bytes"}
"""

from __future__ import annotations

import json
import os
import sys

from gguf import GGUFReader


def weight_bytes_per_token(path: str) -> dict:
    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    total = sum(tensors.values())
    untied = "output.weight" in tensors
    per_token = total - tensors["token_embd.weight"] if untied else total
    return {"file": os.path.basename(path), "bytes_per_token": per_token, "tensor_bytes": total, "tied": not untied}


if __name__ == "__main__":
    print(json.dumps(weight_bytes_per_token(sys.argv[1])))
