"""A live platform with a simulated fleet of three replica groups for regression runs:

- `base`: Llama-3.1-8B on one H100 with vLLM's defaults (weight 100: the background traffic, if any);
- `same`: the same config (weight 0: reached only through the X-Engine-Group header), for A/A runs;
- `slow`: the same with max_num_seqs 2 (weight 0): under concurrent load its requests wait in the queue.

The platform runs the fleet itself (`runplatform --with-engine`, ENGINE_FLEET), as `make up` does; in server
mode it gets a PostgreSQL database of its own (tests/fleet_support.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
from fleet_support import LLAMA_8B_H100, closed_with_directory, group, open_fleet_platform

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="package")
def live(tmp_path_factory):
    groups = [group("base", LLAMA_8B_H100), group("same", LLAMA_8B_H100, weight=0),
              group("slow", {**LLAMA_8B_H100, "max_num_seqs": 2}, weight=0)]
    with closed_with_directory(HERE, open_fleet_platform(
            tmp_path_factory.mktemp("regressions"), name="regressions-test", groups=groups,
            grpc=True,  # test_real_vllm_run.py's vLLM fleet exports its spans over gRPC
            env={"REGRESSIONS_STALE_SECONDS": "6", "REGRESSIONS_SWEEP_INTERVAL_SECONDS": "2",
                 "REGRESSIONS_QUEUED_GRACE_SECONDS": "3"})) as platform:
        yield platform
