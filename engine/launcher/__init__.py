"""Launch and keep alive the engine's processes: vLLM/simulator command lines, the replica supervisor, the fleet.

- ``vllm_command``: ``EngineConfig`` → ``vllm serve`` (or simulator) argv and OTel environment.
- ``supervision_policy``, ``managed_process``, ``supervisor``: replica processes with health checks, restarts
  with backoff, drain and replacement; ``process_groups``: pids and process groups on Linux.
- ``fleet_spec``: the YAML fleet spec; ``run_dir``: the controller's files; ``fleet_controller``: the controller
  (gateway + groups); ``control_api`` / ``control_client``: its HTTP API and the calls to it.
- ``cli``: ``python -m engine up|status|down|render``.
- ``config_replica``: one replica of a config outside any fleet, for the length of a job (a regression run's
  config target).
"""
from engine.launcher.fleet_controller import FleetController
from engine.launcher.fleet_spec import FleetSpec, FleetSpecError
from engine.launcher.managed_process import ManagedProcess
from engine.launcher.supervision_policy import SupervisorPolicy
from engine.launcher.supervisor import ReplacementFailed, Supervisor
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
