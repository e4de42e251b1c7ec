"""Workloads, runner, reports, and the vLLM-faithful engine simulator."""
