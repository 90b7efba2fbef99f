"""Router: the champion/challenger split over many sessions, stickiness, alias refresh, full-weight routes."""

from __future__ import annotations

import pytest

from flywheel.serving.registry import RegisteredVersion
from flywheel.serving.router import Router, bucket, logged_version
from flywheel.serving.tier import TierConfig


class MemoryRegistry:
    """In-memory aliases: the router's only dependency on the registry is alias_versions()."""

    def __init__(self, aliases: dict[str, tuple[int, str]]) -> None:
        self.set(aliases)
        self.fail = False

    def set(self, aliases: dict[str, tuple[int, str]]) -> None:
        self._aliases = {a: RegisteredVersion(v, str(v), kind, "", {}) for a, (v, kind) in aliases.items()}

    def alias_versions(self) -> dict[str, RegisteredVersion]:
        if self.fail:
            raise ConnectionError("registry down")
        return dict(self._aliases)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(aliases: dict[str, tuple[int, str]], share: float = 0.1, loaded: dict[str, int] | None = None,
         servers: list[str] | None = None) -> tuple[Router, MemoryRegistry, Clock]:
    tier = TierConfig(servers=servers or ["http://a"], challenger_share=share, alias_refresh_s=2.0)
    reg, clock = MemoryRegistry(aliases), Clock()
    router = Router(tier, registry=reg, clock=clock, probe=lambda s: (loaded or {}).get(s, 0), background=False)
    return router, reg, clock


def test_split_over_10000_sessions_is_within_2_points_and_sticky() -> None:
    for share in (0.1, 0.3, 0.5):
        router, _, _ = make({"champion": (3, "lora"), "challenger": (4, "lora")}, share=share)
        ids = [f"session-{i}" for i in range(10_000)]
        first = [router.route(s) for s in ids]
        got = sum(r.policy_version == 4 for r in first) / len(ids)
        assert abs(got - share) <= 0.02, f"challenger share {got:.4f} vs configured {share}"
        again = [router.route(s) for s in ids]
        changed = sum(a != b for a, b in zip(first, again))
        assert changed == 0, f"{changed} of 10000 sessions changed version between two calls"
        assert {r.model for r in first} == {"policy-v3", "policy-v4"}
        assert all(r.arm == ("challenger" if r.policy_version == 4 else "champion") for r in first)


def test_bucket_is_stable_and_uniform() -> None:
    assert bucket("abc") == bucket("abc")
    values = [bucket(str(i)) for i in range(5000)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert abs(sum(values) / len(values) - 0.5) < 0.02


def test_no_champion_routes_to_base_policy_v0() -> None:
    router, _, _ = make({})
    route = router.route("s")
    assert (route.model, route.policy_version, route.arm) == ("policy-v0", 0, "champion")


def test_challenger_equal_to_champion_takes_no_share() -> None:
    router, _, _ = make({"champion": (5, "lora"), "challenger": (5, "lora")}, share=0.5)
    assert {router.route(f"s{i}").arm for i in range(200)} == {"champion"}


def test_rollback_reroutes_after_refresh_interval_and_registry_outage_keeps_aliases() -> None:
    router, reg, clock = make({"champion": (7, "lora")}, share=0.0)
    assert router.route("s").policy_version == 7
    reg.set({"champion": (6, "lora")})
    clock.now = 1.0
    assert router.route("s").policy_version == 7, "cached until alias_refresh_s"
    clock.now = 2.5
    assert router.route("s").policy_version == 6, "re-routed after the refresh interval"
    reg.fail = True
    clock.now = 5.0
    assert router.route("s").policy_version == 6, "an unreadable registry keeps the last aliases"


def test_full_weight_route_uses_base_name_and_logs_what_the_server_holds() -> None:
    servers = ["http://a", "http://b"]
    router, _, _ = make({"champion": (9, "full")}, share=0.0, loaded={"http://a": 8, "http://b": 9}, servers=servers)
    routes = {router.route(f"s{i}") for i in range(50)}
    assert {(r.model, r.policy_version, r.server) for r in routes} == {("policy-v0", 9, "http://b")}
    stale, _, _ = make({"champion": (9, "full")}, share=0.0, loaded={"http://a": 8})
    route = stale.route("s")
    assert (route.model, route.policy_version) == ("policy-v0", 8), "logs the version actually loaded"


def test_logged_version_is_none_when_a_reload_happened_during_the_request() -> None:
    assert logged_version(3, 3) == 3
    assert logged_version(3, 4) is None


def test_shares() -> None:
    router, _, _ = make({"champion": (1, "lora"), "challenger": (2, "lora")}, share=0.25)
    assert router.shares() == {1: 0.75, 2: 0.25}


def test_background_refresh_never_blocks_route_after_the_first_read() -> None:
    import threading

    tier = TierConfig(servers=["http://a"], challenger_share=0.0, alias_refresh_s=2.0)
    reg, clock = MemoryRegistry({"champion": (1, "lora")}), Clock()
    gate = threading.Event()
    router = Router(tier, registry=reg, clock=clock, probe=lambda s: 0)
    assert router.route("s").policy_version == 1  # first read is synchronous
    slow = reg.alias_versions
    reg.alias_versions = lambda: (gate.wait(5), slow())[1]  # a registry that hangs until released
    reg.set({"champion": (2, "lora")})
    clock.now = 3.0
    assert router.route("s").policy_version == 1, "route() answered from the cache while the refresh hangs"
    gate.set()
    for _ in range(100):
        if router.route("s").policy_version == 2:
            break
        threading.Event().wait(0.02)
    assert router.route("s").policy_version == 2, "the background refresh never landed"


def test_the_snapshot_says_since_when_the_aliases_in_use_were_read_and_a_hung_refresh_does_not_advance_it() -> None:
    import threading
    import time

    tier = TierConfig(servers=["http://a"], challenger_share=0.5, alias_refresh_s=2.0)
    reg, clock = MemoryRegistry({"champion": (1, "lora"), "challenger": (2, "lora")}), Clock()
    router = Router(tier, registry=reg, clock=clock, probe=lambda s: 0)
    assert router.snapshot() == {"aliases": {}, "read_at": None}, "nothing read yet"
    router.route("s")
    first = router.snapshot()
    assert first["aliases"] == {"champion": 1, "challenger": 2} and first["read_at"] <= time.time()
    gate = threading.Event()
    slow = reg.alias_versions
    reg.alias_versions = lambda: (gate.wait(5), slow())[1]
    reg.set({"champion": (1, "lora")})  # the challenger alias is cleared
    cleared_at = time.time()
    clock.now = 3.0
    router.route("s")  # starts the refresh, which hangs
    assert router.snapshot() == first, "a refresh in flight is not what routes: the snapshot must not claim it"
    gate.set()
    for _ in range(100):
        if router.snapshot()["read_at"] != first["read_at"]:
            break
        threading.Event().wait(0.02)
    now = router.snapshot()
    assert now["aliases"] == {"champion": 1} and now["read_at"] > cleared_at
    assert {router.route(f"s{i}").arm for i in range(200)} == {"champion"}, "read after the clear: no challenger"


def test_three_arms_control_challenger_champion_and_the_control_stays_put() -> None:
    tier = TierConfig(servers=["http://a", "http://b", "http://c"], challenger_share=0.4, control_share=0.2,
                      alias_refresh_s=2.0)
    loaded = {"http://a": 0, "http://b": 3, "http://c": 4}
    reg, clock = MemoryRegistry({"champion": (3, "full"), "challenger": (4, "full")}), Clock()
    router = Router(tier, registry=reg, clock=clock, probe=lambda s: loaded[s], background=False)
    ids = [f"session-{i}" for i in range(10_000)]
    routes = {s: router.route(s) for s in ids}
    for arm, share, version, server in (("control", 0.2, 0, "http://a"), ("challenger", 0.4, 4, "http://c"),
                                        ("champion", 0.4, 3, "http://b")):
        mine = [r for r in routes.values() if r.arm == arm]
        assert abs(len(mine) / len(ids) - share) <= 0.02, (arm, len(mine))
        assert {(r.policy_version, r.server) for r in mine} == {(version, server)}, arm
    # no challenger (rejected, or the final window): its sessions go to the champion, the control keeps its own
    reg.set({"champion": (3, "full")})
    clock.now += 5
    after = {s: router.route(s) for s in ids}
    assert all(after[s].arm == "control" for s in ids if routes[s].arm == "control")
    assert {r.arm for r in after.values()} == {"control", "champion"}
    assert router.shares() == {0: 0.2, 3: 0.8}
    reg.set({"champion": (3, "full"), "challenger": (4, "full")})
    clock.now += 5
    assert router.shares() == {0: 0.2, 3: pytest.approx(0.4), 4: 0.4}


def test_spare_to_control_gives_an_idle_challengers_range_to_the_control_and_never_the_champions() -> None:
    tier = TierConfig(servers=["http://a", "http://b", "http://c"], challenger_share=0.4, control_share=0.2,
                      alias_refresh_s=2.0, spare_to_control=True)
    loaded = {"http://a": 0, "http://b": 3, "http://c": 4}
    reg, clock = MemoryRegistry({"champion": (3, "full"), "challenger": (4, "full")}), Clock()
    router = Router(tier, registry=reg, clock=clock, probe=lambda s: loaded[s], background=False)
    ids = [f"session-{i}" for i in range(10_000)]
    live = {s: router.route(s).arm for s in ids}
    assert abs(sum(a == "challenger" for a in live.values()) / len(ids) - 0.4) <= 0.02, "a live test is unchanged"
    reg.set({"champion": (3, "full")})  # the final window: the challenger cleared
    clock.now += 5
    idle = {s: router.route(s) for s in ids}
    assert all(idle[s].arm == "control" and idle[s].policy_version == 0 for s in ids if live[s] != "champion")
    assert all(idle[s].arm == "champion" for s in ids if live[s] == "champion"), "the champion's range never moves"
    assert router.shares() == {0: pytest.approx(0.6), 3: pytest.approx(0.4)}


def test_control_and_challenger_shares_must_leave_the_champion_some() -> None:
    from flywheel.base.config import ConfigError

    with pytest.raises(ConfigError, match="exceeds 1"):
        TierConfig(control_share=0.6, challenger_share=0.5).check()


def test_a_version_no_server_holds_falls_back_to_the_champions_server_never_to_a_challengers() -> None:
    tier = TierConfig(servers=["http://a", "http://b", "http://c"], challenger_share=0.4, control_share=0.2)
    loaded = {"http://a": 0, "http://b": 3, "http://c": 4}
    # the champion alias already names v5 (a rollback target still loading): its arm must not land on v4's server
    reg = MemoryRegistry({"champion": (5, "full"), "challenger": (4, "full")})
    router = Router(tier, registry=reg, clock=Clock(), probe=lambda s: loaded[s], background=False)
    champion_routes = [r for r in (router.route(f"s-{i}") for i in range(500)) if r.arm == "champion"]
    assert champion_routes and {r.server for r in champion_routes} == {"http://a"}, {r.server for r in champion_routes}
    assert {r.policy_version for r in champion_routes} == {0}, "logged as what the server really holds"
