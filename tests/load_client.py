"""Sends a set of requests to a server from a process of its own, for test_server_amplification.py.

Usage: ``python load_client.py BASE_URL SPEC_FILE``. SPEC_FILE is JSON: ``{"requests": [[path,
body file or null (a GET)], ...], "repeat": R, "concurrency": C}``. Prints ``go`` as it starts
sending, then, once every answer is in, one JSON line: ``[[status, error param or null], ...]``.

Its own process, so that the client timing the normal request beside this load does not itself
spend the time reading these answers (the machine's cores are few).
"""

from __future__ import annotations

import asyncio
import json
import sys

import httpx


async def main(base_url: str, spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    bodies = {}
    for _, body_path in spec["requests"]:
        if body_path is not None and body_path not in bodies:
            with open(body_path, "rb") as f:
                bodies[body_path] = f.read()
    gate = asyncio.Semaphore(spec["concurrency"])
    limits = httpx.Limits(max_connections=spec["concurrency"])
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:

        async def send(path: str, body_path: str | None) -> list:
            async with gate:
                if body_path is None:
                    r = await client.get(path)
                else:
                    headers = {"content-type": "application/json"}
                    r = await client.post(path, content=bodies[body_path], headers=headers)
                param = r.json()["error"]["param"] if r.status_code >= 400 else None
                return [r.status_code, param]

        print("go", flush=True)
        answers = await asyncio.gather(*(send(p, b) for p, b in spec["requests"] * spec["repeat"]))
    print(json.dumps(answers), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
