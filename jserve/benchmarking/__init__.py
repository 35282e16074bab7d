"""Workloads, arrival processes, trace replay, metrics, benchmarks and sweeps."""
