"""The tuning tests' live platform: a simulated fleet whose group `base` runs Llama-3.1-8B on one (simulated)
H100 with max_num_seqs 8, a poor config for chat traffic at tens of requests/s, which a study must beat and its
confirmation must show; and one whose group `real` runs real vLLM. The platform runs the fleet itself
(`runplatform --with-engine`); in server mode it gets a PostgreSQL database of its own (tests/fleet_support.py)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from fleet_support import LLAMA_8B_H100, FleetPlatform, closed_with_directory, group, open_fleet_platform

HERE = Path(__file__).resolve().parent

# The scratch ClickHouse store and request rows of the alerts tests (tests/alerts/alerts_support.py).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "alerts"))


class Live(FleetPlatform):
    def wait(self, study_id: int, timeout: float = 400) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status, study = self.api("GET", f"/api/v1/tuning-studies/{study_id}")
            assert status == 200, study
            if study["state"] not in ("queued", "searching", "rescoring", "confirming"):
                return study
            time.sleep(0.5)
        raise AssertionError(f"study {study_id} did not end: {study}\n{self.process.log_tail()}")


@pytest.fixture(scope="package")
def live(tmp_path_factory):
    with closed_with_directory(HERE, open_fleet_platform(
            tmp_path_factory.mktemp("tuning"), name="tuning-test", cls=Live,
            groups=[group("base", {**LLAMA_8B_H100, "max_num_seqs": 8})],
            env={"TUNING_STALE_SECONDS": "6", "TUNING_SWEEP_INTERVAL_SECONDS": "2",
                 "TUNING_QUEUED_GRACE_SECONDS": "3", "TUNING_CONFIRM_MAX_RATE": "16", "TUNING_CONFIRM_ITEMS": "80",
                 # A first replay at 3x the predicted goodput, which a winner under the cap misses: the steps down
                 # are tested (test_tuning_live.py). Winners above the cap are replayed at the cap only.
                 "TUNING_CONFIRM_RATE_STEPS": "3,1,0.7,0.5",
                 # Two workers share each study's trials (ask-and-tell on the shared Optuna storage).
                 "TUNING_PARALLEL_TRIALS": "2",
                 # Smaller studies than the defaults (the winner still clearly beats max_num_seqs 8): 200
                 # simulated requests per rate, the best 3 re-scored over 3 seeds.
                 "TUNING_SIM_REQUESTS": "200", "TUNING_RESCORE_CANDIDATES": "3", "TUNING_RESCORE_SEEDS": "3",
                 "REGRESSIONS_SWEEP_INTERVAL_SECONDS": "2", "REGRESSIONS_QUEUED_GRACE_SECONDS": "3"})) as platform:
        yield platform


@pytest.fixture(scope="module")
def vllm_live(tmp_path_factory, real_vllm_executable, tiny_model_dir):
    """A platform whose fleet's group `real` runs real vLLM (test_tuning_real_vllm.py; opt-in)."""
    config = {"model": tiny_model_dir, "gpu_type": "CPU", "max_num_seqs": 2, "kv_cache_memory_bytes": 33554432}
    with open_fleet_platform(
            tmp_path_factory.mktemp("tuning-vllm"), name="tuning-vllm", cls=Live,
            groups=[group("real", config, backend="vllm", served_model_name="tiny-llama")],
            vllm_executable=real_vllm_executable, grpc=True,  # vLLM exports its spans over gRPC only
            keys=("default",), start_timeout=300,
            env={"TUNING_SWEEP_INTERVAL_SECONDS": "2", "TUNING_QUEUED_GRACE_SECONDS": "3",
                 "TUNING_CONFIRM_MAX_RATE": "6", "TUNING_CONFIRM_ITEMS": "60", "TUNING_SIM_REQUESTS": "200",
                 "TUNING_RESCORE_CANDIDATES": "2", "TUNING_RESCORE_SEEDS": "3",
                 "REGRESSIONS_SWEEP_INTERVAL_SECONDS": "2", "REGRESSIONS_QUEUED_GRACE_SECONDS": "3"}) as platform:
        yield platform


@pytest.fixture(scope="module")
def store():
    """A scratch ClickHouse store that traces.store.get_store() hands out for the module's tests."""
    from alerts_support import installed_store

    with installed_store() as scratch:
        yield scratch
