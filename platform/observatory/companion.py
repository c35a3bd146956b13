"""The simulated fleet and a gentle load that `make up` runs next to the platform (`runplatform --with-engine`)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

from fleet.wiring import engine_environment


class EngineCompanion:
    """The simulated fleet and a gentle load that ``make up`` runs next to the platform, stopped with it.

    The fleet controller is started detached (``python -m engine up --detach``, which returns
    once the gateway and replicas are healthy) and stopped with ``engine down``; the load
    generator is a child process sending Poisson traffic through the gateway for as long as
    the platform runs. Both export their spans to this platform.
    """

    def __init__(self, *, fleet: str | None = None, load_rate: float = 0.0, http_bind: str | None = None,
                 project: str = "default"):
        self.fleet = fleet
        self.load_rate = load_rate
        wiring = engine_environment(project, http_bind)
        if fleet or os.environ.get("ENGINE_FLEET"):
            wiring.pop("ENGINE_RUN_DIR")  # a fleet file of one's own keeps its own run_dir
        self.env = {**wiring, **os.environ}  # what the user set wins over the platform's wiring
        self.load_process = None
        self.started = False

    def _engine(self, *args: str, timeout: float | None = None):
        argv = [sys.executable, "-m", "engine", *args]
        if self.fleet:
            argv += ["--fleet", self.fleet]
        return subprocess.run(argv, env=self.env, timeout=timeout, check=False)

    def start(self) -> None:
        result = self._engine("up", "--detach")
        if result.returncode != 0:
            raise RuntimeError("the engine fleet did not start (see the message above)")
        self.started = True
        if self.load_rate > 0:
            self._stopping = threading.Event()
            self._load_thread = threading.Thread(target=self._keep_load_running, name="engine-load", daemon=True)
            self._load_thread.start()

    # The load generator plans a run's arrivals up front and keeps every request's record, so
    # an endless background load is a chain of bounded runs rather than one unbounded one.
    LOAD_RUN_SECONDS = 300
    SHARED_PREFIX_TOKENS = 96

    def _keep_load_running(self) -> None:
        gateway = self.env.get("ENGINE_GATEWAY_BIND") or "127.0.0.1:8100"
        argv = [sys.executable, "-m", "engine.loadgen", "--base-url", f"http://{gateway}/v1",
                "--arrival", "poisson", "--rate", str(self.load_rate), "--duration", str(self.LOAD_RUN_SECONDS),
                "--quiet", "--timeout", "120",
                # A system prompt every request shares, as chat traffic has: the prefix cache serves it.
                "--shared-prefix-len", str(self.SHARED_PREFIX_TOKENS)]
        seed = 0
        while not self._stopping.is_set():
            seed += 1
            self.load_process = subprocess.Popen(argv + ["--seed", str(seed)], env=self.env,
                                                 stdout=subprocess.DEVNULL)
            self.load_process.wait()
            # A failing run (gateway down, say) is retried, but not in a tight loop.
            self._stopping.wait(0 if self.load_process.returncode == 0 else 10)

    def stop(self) -> None:
        if getattr(self, "_stopping", None) is not None:
            self._stopping.set()
        if self.load_process is not None and self.load_process.poll() is None:
            self.load_process.terminate()
            try:
                self.load_process.wait(15)
            except subprocess.TimeoutExpired:
                self.load_process.kill()
        if self.started:
            self.started = False
            self._engine("down", timeout=180)
