"""Tensor parallelism on one node: the process group and its collectives (group.py), and the
executors that run one model-runner step on every rank (mp_executor.py, ray_executor.py,
worker.py). The layers that hold a rank's shard are pagedllm.layers'. See docs/scaling.md."""
