"""The whole loop, unattended, on a simulated fleet (loops.bench's scenario, `run`): group `base` (Llama-3.1-8B on
a simulated H100, max_num_seqs 2) serves a Poisson load through the gateway; its engine model is calibrated from
that traffic; the project's policy is `auto`. Then its load doubles: requests queue, the TTFT SLO pages, the page's
diagnosis names the queue of `base`, and the loop runs by itself: a tuning study on the group's traffic within the
policy's knobs (max_num_seqs at most x2), its winner confirmed on replicas, a rollout with one canary step,
promotion, and the SLO's burn rate back under 1 within the watch. Every step is in the loop's timeline with its
figures, and each one reached the project's webhook.

The simulated replicas stand in for GPUs (none here). The suite's longest test (about five minutes on two cores,
most of it the healthy start, the model's fit and the watch's three minutes), so it runs in one suite only: the
embedded one, which is the shorter of the two. `python -m loops.bench` prints the same scenario's times."""
from __future__ import annotations

import dataclasses
import subprocess

import pytest
from alerts_support import Receiver
from fleet_support import FleetPlatform, group, open_fleet_platform
from loops import bench

pytestmark = pytest.mark.one_suite(suite="embedded")


@dataclasses.dataclass(eq=False)
class World(FleetPlatform):
    loads: list = dataclasses.field(default_factory=list)

    def load(self, seed: int) -> None:
        self.loads.append(bench.start_load(self.process.env, self.gateway, seed, self.root / f"load-{seed}.log"))

    def stop_loads(self) -> None:
        for load in self.loads:
            load.terminate()
        for load in self.loads:
            try:
                load.wait(20)
            except subprocess.TimeoutExpired:
                load.kill()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    with open_fleet_platform(
            tmp_path_factory.mktemp("loops"), name="loop-test", cls=World, groups=[group("base", bench.BASE)],
            tokens=(("root", "admin"),),
            env={**bench.PLATFORM_ENV, "NOTIFY_ALLOW_PRIVATE_DESTINATIONS": "127.0.0.1:1024-65535"}) as platform:
        try:
            yield platform
        finally:
            platform.stop_loads()


def test_a_doubled_load_is_paged_tuned_rolled_out_and_restored_unattended(world):
    receiver = Receiver()
    try:
        result = bench.run(world.api, world.load, tail=lambda: world.process.log_tail(4000),
                           channel_url=receiver.url)
        final, steps = result["loop"], result["steps"]
        assert final["group"] == "base" and final["trigger"]["component"] == "queue", final["trigger"]
        assert final["state"] == "restored", [(s["step"], s["reason"]) for s in final["steps"]]
        assert list(steps) == ["started", "study_started", "proposed", "rollout_started", "promoted",
                               "burn_below_1", "restored"], list(steps)
        proposal = steps["proposed"]["figures"]["proposal"]
        assert proposal["diff"]["max_num_seqs"] == {"current": 2, "proposed": 4}, proposal  # at most x2
        assert steps["proposed"]["figures"]["confirmed_goodput"], steps["proposed"]["figures"]
        assert steps["study_started"]["figures"]["engine_model"] == result["model"]["id"]
        status, rollout = world.api("GET", f"/api/v1/rollouts/{final['rollout']}")
        assert rollout["state"] == "promoted" and rollout["config"]["max_num_seqs"] == 4, rollout
        # One study and one rollout: overlapping ticks leave each to the tick that claimed it.
        studies = [s for s in world.api("GET", "/api/v1/tuning-studies")[1]["studies"]
                   if s["created_by"] == f"loop {final['id']}"]
        assert [s["id"] for s in studies] == [steps["study_started"]["figures"]["study"]], studies
        rollouts = [r for r in world.api("GET", "/api/v1/rollouts")[1]["rollouts"]
                    if r["created_by"] == f"loop {final['id']}"]
        assert [r["id"] for r in rollouts] == [final["rollout"]], rollouts
        assert all(s["actor"] == "loop" for s in final["steps"])
        # Every step reached the webhook, in order.
        sent = bench.until("every step's notification", lambda: (lambda got: got if len(got) >= len(steps) else None)(
            [b["labels"]["step"] for b in receiver.bodies() if b.get("kind") == "loop"]), 60)
        assert sent == list(steps), sent
        assert list(result["times"]) == ["page", "study_done", "rollout_started", "canary", "promoted", "burn_below_1",
                                         "restored"], result["times"]
        print(f"\nloop times (s): {result['times']}")
    finally:
        receiver.close()


def test_the_loop_page_draws_its_timeline_in_the_browser(world, browser, shots):
    """After the loop above: its page as an admin sees it, linked from the alert that started it."""
    from browser_support import BrowserSession, dashboard_login

    [loop] = world.api("GET", "/api/v1/loops")[1]["loops"]
    session = BrowserSession(browser, world.process.url)
    try:
        session.login("root", dashboard_login(world.process, "root", "admin"))
        session.goto(f"/loops/{loop['id']}/")
        steps = session.page.locator("[data-testid=timeline] li").evaluate_all("els => els.map(e => e.dataset.step)")
        assert steps == [s["step"] for s in world.api("GET", f"/api/v1/loops/{loop['id']}")[1]["steps"]], steps
        assert session.page.locator("[data-testid=state]").inner_text() == "restored"
        assert session.page.locator("[data-testid=proposal]").is_visible()
        session.page.screenshot(path=str(shots / "loop.png"), full_page=True)
        session.goto(f"/alerts/{loop['alert']}/")
        link = session.page.locator("[data-testid=alert-loops] a")
        assert link.inner_text() == f"loop #{loop['id']}"
        session.goto("/loops/")
        session.page.screenshot(path=str(shots / "loops.png"), full_page=True)
        assert session.errors == []
    finally:
        session.close()
