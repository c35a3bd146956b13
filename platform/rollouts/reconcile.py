"""What the fleet must look like at a rollout's step, made so on every tick rather than remembered: the canary
group (and the baseline twin) on their configs, the gateway's weights, and after the rollout the fleet as it was. A
restarted platform or fleet controller so resumes the same step: a canary group lost with a controller restart is
started again, weights the gateway forgot are sent again."""
from __future__ import annotations

from fleet.control import control, group_of, healthy_replicas

from engine.config import EngineConfig

from .models import Rollout
from .plan import canary_gateway_weights


def ensure_canary(rollout: Rollout, fleet: dict, weight_percent: float) -> bool:
    """The canary group runs the new config (and the baseline twin, when the plan has one, the group's config on as
    many replicas) and the gateway gives each ``weight_percent`` % of the group's traffic; True once their replicas
    are healthy."""
    wanted = [(rollout.canary_group, rollout.config, rollout.config_version)]
    if rollout.twin_group:
        wanted.append((rollout.twin_group, rollout.baseline_config,
                       EngineConfig.from_dict(rollout.baseline_config).version))
    ready = True
    for name, config, version in wanted:
        group = group_of(fleet, name)
        if group is not None and group.get("config_version") != version:
            control("DELETE", f"/fleet/groups/{name}")
            group = None
        if group is None:
            control("PUT", f"/fleet/groups/{name}",
                    {"base": rollout.group, "config": config, "replicas": rollout.plan["canary_replicas"],
                     "weight": 0})
            ready = False
        elif healthy_replicas(fleet, name) < rollout.plan["canary_replicas"]:
            ready = False
    if not ready:
        return False
    ensure_weights(rollout, fleet, weight_percent)
    return True


def ensure_weights(rollout: Rollout, fleet: dict, weight_percent: float | None) -> None:
    """Gateway weights as the step wants them (None: the weights from before the rollout, canary and twin at 0)."""
    current = {g["name"]: float(g.get("weight") or 0) for g in fleet.get("groups") or []}
    base = {name: float(w) for name, w in (rollout.baseline_weights or {}).items() if name in current}
    if weight_percent:
        wanted = canary_gateway_weights(base, rollout.group, rollout.canary_group, weight_percent,
                                        twin=rollout.twin_group)
    else:
        wanted = dict(base)
        for name in (rollout.canary_group, rollout.twin_group):
            if name and name in current:
                wanted[name] = 0.0
    if all(abs(current.get(name, -1) - w) < 1e-9 for name, w in wanted.items()):
        return
    control("PUT", "/fleet/weights", {"weights": wanted})


def restore_fleet(rollout: Rollout, fleet: dict, *, keep_config: bool) -> bool:
    """Weights as before the rollout, the canary group removed, the group on its old config unless kept; False while
    something is still under way (a replacement of the group), to be looked at again."""
    ensure_weights(rollout, fleet, None)
    for name in (rollout.canary_group, rollout.twin_group):
        if name and group_of(fleet, name) is not None:
            control("DELETE", f"/fleet/groups/{name}")
    if keep_config:
        return True
    group = group_of(fleet, rollout.group)
    baseline = EngineConfig.from_dict(rollout.baseline_config)
    if group is None or group.get("config_version") in (None, baseline.version):
        return True
    if group.get("transition"):
        return False  # a promotion's replacement is under way: put the old config back once it is done
    control("PUT", f"/fleet/groups/{rollout.group}/config", {"config": rollout.baseline_config})
    return False
