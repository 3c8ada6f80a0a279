"""Tensor parallelism on torch.distributed (spec/parallel.md): sharding, the process group, the step protocol,
starting and stopping the workers."""
