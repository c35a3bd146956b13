"""Launch and keep alive the engine's processes: vLLM/simulator command lines, the replica supervisor, the fleet.

- ``vllm_command``: ``EngineConfig`` → ``vllm serve`` (or simulator) argv and OTel environment.
- ``supervisor``: replica processes with health checks, restarts with backoff, drain and replacement.
- ``fleet``: the YAML fleet spec and the controller (gateway + groups + control API).
- ``cli``: ``python -m engine up|status|down|render``.
"""
from engine.launcher.fleet import FleetController, FleetSpec, FleetSpecError
from engine.launcher.supervisor import ManagedProcess, ReplacementFailed, Supervisor, SupervisorPolicy
from engine.launcher.vllm_command import LaunchCommand, render_simulator_command, render_vllm_command

__all__ = [
    "FleetController",
    "FleetSpec",
    "FleetSpecError",
    "LaunchCommand",
    "ManagedProcess",
    "ReplacementFailed",
    "Supervisor",
    "SupervisorPolicy",
    "render_simulator_command",
    "render_vllm_command",
]
