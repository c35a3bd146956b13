"""The engine simulator: a calibrated discrete-event model of vLLM's V1 scheduler, labelled as a simulation.

    from engine.config import EngineConfig
    from engine.sim import EngineCore, SimRequest, simulate

``EngineCore`` steps one simulated replica on the caller's clock (the real-time
replica server drives it); ``simulate`` runs a whole workload in virtual time.
Profiles, the KV block pool, the roofline cost model, speculative decoding and the
calibration against published vLLM figures live in the modules of this package;
``docs/engine-simulator.md`` describes the model and its limits.
"""
from engine.sim.core import EngineCore
from engine.sim.memory import SimulationConfigError
from engine.sim.options import SimOptions
from engine.sim.profiles import HardwareProfile, ModelProfile, UnknownProfileError, hardware_profile, model_profile
from engine.sim.request import RequestRejected, SimRequest, StepOutput
from engine.sim.virtual import SimulationResult, SimulationSummary, simulate

__all__ = [
    "EngineCore",
    "HardwareProfile",
    "ModelProfile",
    "RequestRejected",
    "SimOptions",
    "SimRequest",
    "SimulationConfigError",
    "SimulationResult",
    "SimulationSummary",
    "StepOutput",
    "UnknownProfileError",
    "hardware_profile",
    "model_profile",
    "simulate",
]
