"""Tensor parallelism on one node: Megatron-style sharding of the Llama family over
torch.distributed (gloo on the CPU) and the multiprocessing executor that runs one model-runner
step on every rank. See docs/scaling.md."""
