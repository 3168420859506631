"""Peak resident memory of `pagedllm serve` on the default model with a fixed KV cache, under load.

Starts the server (native Q4_1 GGUF, --kv-cache-memory-gib 0.25), sends 16 concurrent completion
requests of 150 + 128 tokens, then reads the server's VmHWM (peak RSS) from /proc. The bar it is
held to: the GGUF file's size + the KV cache + 400 MiB. Writes raw/serve_rss.json (summarize.py
puts it in results.md). Run it under the benchmark lock, as run_vs_llamacpp.sh does.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
KV_GIB = 0.25
MODEL = "smollm2-135m-instruct"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def main() -> None:
    from pagedllm.models.resolve import default_model_gguf_path

    gguf = default_model_gguf_path()
    port = _free_port()
    args = ["serve", MODEL, "--kv-cache-memory-gib", str(KV_GIB)]
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", *args, "--port", str(port)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline or server.poll() is not None:
                raise SystemExit("server did not start")
            time.sleep(1)
        idle_kib = _status_kib(server.pid, "VmRSS")
        body = {"model": MODEL, "prompt": [1000 + i for i in range(150)], "max_tokens": 128, "ignore_eos": True}

        def one(_: int) -> int:
            return httpx.post(base + "/v1/completions", json=body, timeout=600).status_code

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            codes = list(pool.map(one, range(16)))
        peak_kib = _status_kib(server.pid, "VmHWM")
    finally:
        server.terminate()
        server.wait(timeout=60)
    file_mib = os.path.getsize(gguf) / 2**20
    kv_mib = KV_GIB * 1024
    result = {
        "command": " ".join(["pagedllm", *args]),
        "requests": len(codes),
        "ok": sum(c == 200 for c in codes),
        "file_mib": round(file_mib, 1),
        "kv_cache_mib": kv_mib,
        "idle_rss_mib": round(idle_kib / 1024, 1),
        "peak_rss_mib": round(peak_kib / 1024, 1),
        "bar_mib": round(file_mib + kv_mib + 400, 1),
    }
    os.makedirs(os.path.join(HERE, "raw"), exist_ok=True)
    with open(os.path.join(HERE, "raw", "serve_rss.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
