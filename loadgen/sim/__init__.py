"""The engine simulator: vLLM V1's prefix cache, scheduler and observability, without a model.

Public entry points::

    from loadgen.sim import SimConfig, run_simulator, run_simulator_process
"""

from loadgen.sim.server import (
    SimConfig,
    SimEndpoints,
    Simulator,
    run_simulator,
    run_simulator_process,
)

__all__ = ["SimConfig", "SimEndpoints", "Simulator", "run_simulator", "run_simulator_process"]
