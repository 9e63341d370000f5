"""Floor 2, the only floor that calls torch.distributed: `Comm` (collectives.py: the process group,
counted collectives, peer-loss detection; p2p.py: gloo's all-gather as point-to-point messages),
the order checks every collective passes (ordering.py) and the DTensor and device-mesh helpers of
tensor parallelism (tensor_parallel.py), and hybrid sharding's shard groups (shard_groups.py)."""
