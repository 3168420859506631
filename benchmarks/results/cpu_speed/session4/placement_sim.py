"""How contiguous block tables stay under placement: the 200-request workload admitted at once into
a 4 GiB cache (11,650 blocks of 16), then decoded in lockstep, each request to its real length.

python placement_sim.py exact|huge   ("huge": every request declares max_tokens = 8192 - prompt, as
a chat request without max_tokens does, so each new sequence asks for 512 blocks of room)
Prints the fraction of neighbouring entries of the finished block tables that are adjacent blocks.
"""

import json
import sys

from pagedllm.kv.paged import PagedKVCacheManager
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

WORKLOAD = "/root/anchors/workload-200.json"
NUM_BLOCKS, BLOCK_SIZE, MAX_MODEL_LEN = 11650, 16, 8192


def main() -> None:
    mode = sys.argv[1]
    kv = PagedKVCacheManager(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    live: list[tuple[Request, int]] = []
    for i, r in enumerate(json.load(open(WORKLOAD))["requests"]):
        prompt, target = r["prompt_token_ids"], r["max_tokens"]
        max_tokens = target if mode == "exact" else MAX_MODEL_LEN - len(prompt)
        req = Request(str(i), prompt, SamplingParams(max_tokens=max_tokens))
        assert kv.allocate_slots(req, req.num_tokens)
        req.num_computed_tokens = req.num_tokens
        req.append_output_token(1)
        live.append((req, target))
    adjacent = pairs = 0
    while live:
        still = []
        for req, target in live:
            if req.num_output_tokens >= target:
                table = kv.block_table(req.request_id)
                adjacent += sum(1 for a, b in zip(table, table[1:], strict=False) if b == a + 1)
                pairs += len(table) - 1
                kv.free(req)
                continue
            assert kv.allocate_slots(req, 1)
            req.num_computed_tokens += 1
            req.append_output_token(1)
            still.append((req, target))
        live = still
    print(f"{mode}: adjacent neighbouring blocks {adjacent}/{pairs} = {adjacent / pairs:.3f}")


if __name__ == "__main__":
    main()
