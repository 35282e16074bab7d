"""Runners execute a batch: the JAX runner on a device, the simulator's runner on a cost model."""
