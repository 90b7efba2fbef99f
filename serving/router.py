"""Policy router: which policy version (and served model name, and server) answers a session.

`Router(tier).route(session_id) -> Route`. Three arms, sticky per session (a hash of session_id,
so every call of one session goes to one version):
  control     `control_share` of all sessions, always served by `control_version` (the base,
              policy-v0, unless configured), for the whole run: the concurrent baseline;
  challenger  `challenger_share` of all sessions while there is a challenger;
  champion    the rest (without a challenger, `spare_to_control` gives the challenger's range to the control).
The arm is logged on every llm_call (the capture proxy takes it from the Route), so the gate and the
report compare versions only on sessions served at the same time. Aliases are read from the MLflow registry and cached
for `alias_refresh_s` seconds, so a promotion or rollback re-routes within seconds. No champion yet
means the base model, policy-v0. An unreadable registry keeps the last known aliases (the proxy in
front of production traffic must not fail because MLflow hiccuped).

Versions and served names: a LoRA version is served under its own name policy-v<N>. Full weights
replace what a server holds, under the base served name (policy-v0 by default), so for a full
version the route goes to a server whose /weight_info reports that version; if none does, the
route says what that server really holds, because `Route.policy_version` is what the capture
proxy logs on the llm_call and the learner's importance correction depends on it.

Exactness while a full push runs: the publisher pauses a server with mode=wait, so a request
runs entirely on the old or entirely on the new weights. A proxy that wants to be exact reads
`Router.loaded_version(server)` before and after the request: `logged_version(before, after)`
returns the version when both agree and None when a reload happened in between (drop that
sample rather than log a wrong version).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from flywheel.base.versions import version_name
from flywheel.serving.tier import TierConfig

log = logging.getLogger(__name__)

# The router's config is the tier's: servers, registry, challenger_share, alias_refresh_s (FLYWHEEL_* env works).
RouterConfig = TierConfig


@dataclass(frozen=True)
class Route:
    """Where one session's request goes and which version gets logged for it."""

    model: str  # model name to send to vLLM
    policy_version: int  # the version that answers: log this on the llm_call
    kind: str = "full"  # "lora" | "full" (version 0, the base, counts as full)
    arm: str = "champion"  # "control" | "champion" | "challenger"
    server: str = ""  # base URL of the vLLM server to send it to


def bucket(session_id: str) -> float:
    """A uniform, stable number in [0, 1) for a session id (the same in every process and run)."""
    digest = hashlib.sha256(session_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


ARMS = ("control", "champion", "challenger")


def arm_of(session_id: str, challenger_share: float, has_challenger: bool, control_share: float = 0.0,
           spare_to_control: bool = False) -> str:
    """The session's arm: control for the first control_share of the hash range, then the challenger, then the champion.

    The control's range does not depend on whether there is a challenger, so a session of the
    control arm stays there for the whole run. With spare_to_control and no challenger, the
    challenger's range is the control's too (the champion's range never changes).
    """
    b = bucket(session_id)
    if b < control_share:
        return "control"
    if b < control_share + challenger_share:
        return "challenger" if has_challenger else ("control" if spare_to_control else "champion")
    return "champion"


@dataclass(frozen=True)
class _Slot:
    version: int
    kind: str


def logged_version(before: int, after: int) -> int | None:
    """The full-weight version that served a request, from reads before and after it; None if ambiguous."""
    return before if before == after else None


class Router:
    """Maps sessions to policy versions from the registry's champion/challenger aliases."""

    def __init__(self, tier: TierConfig | None = None, registry: Any | None = None,
                 clock: Callable[[], float] = time.monotonic, probe: Callable[[str], int] | None = None,
                 background: bool = True) -> None:
        self.tier = tier or TierConfig()
        self._registry = registry
        self._clock = clock
        self._probe_fn = probe
        self._lock = threading.Lock()
        self._slots: dict[str, _Slot] = {}
        self._loaded: dict[str, int] = {}  # server -> full-weight version it holds
        self._fetched_at = float("-inf")
        self._read_at: float | None = None  # wall clock when the aliases now in use began to be read
        self._refreshing = False
        self.background = background
        self._warned: set[tuple[int, int]] = set()

    @property
    def registry(self) -> Any:
        if self._registry is None:
            from flywheel.serving.registry import Registry

            self._registry = Registry(self.tier.mlflow_tracking_uri, self.tier.registered_model)
        return self._registry

    # -- state ----------------------------------------------------------------------------------
    def refresh(self, force: bool = False) -> None:
        """Re-read aliases (and servers' loaded full weights) when the cache is older than alias_refresh_s.

        The first read blocks (there is nothing to route with yet). Later ones run on a background
        thread while route() keeps answering from the cache, because the capture proxy calls route()
        on its event loop and an MLflow query there would stall every request in flight.
        """
        stale = force or self._clock() - self._fetched_at >= self.tier.alias_refresh_s
        if not stale:
            return
        if not self.background or self._fetched_at == float("-inf") or force:
            self._reload()
            return
        with self._lock:
            if self._refreshing:
                return
            self._refreshing = True
        threading.Thread(target=self._reload, name="router-refresh", daemon=True).start()

    def _reload(self) -> None:
        read_at = time.time()  # before the read: aliases set before this moment are in what it returns
        try:
            try:
                slots = {alias: _Slot(rv.policy_version, rv.kind or "lora")
                         for alias, rv in self.registry.alias_versions().items()}
            except Exception as exc:  # keep serving on the last known aliases
                log.warning("router: registry %s unreadable (%s); keeping aliases %s", self.tier.registered_model, exc,
                            {a: s.version for a, s in self._slots.items()})
                self._fetched_at = self._clock()
                return
            # one GET per server per refresh: full weights can change under the base served name
            loaded = {server: self._probe(server) for server in self.tier.servers}
            if {a: s.version for a, s in slots.items()} != {a: s.version for a, s in self._slots.items()}:
                log.info("router: aliases now %s", {a: s.version for a, s in slots.items()})
            # plain attribute swaps: a concurrent route() sees the old or the new state, never a mix of fields
            self._loaded, self._slots = loaded, slots
            self._fetched_at, self._read_at = self._clock(), read_at
        finally:
            with self._lock:
                self._refreshing = False

    def _probe(self, server: str) -> int:
        from flywheel.serving.vllm_client import ServerError, weight_version

        if self._probe_fn is not None:
            return self._probe_fn(server)
        try:
            return weight_version(server.rstrip("/"), timeout=2.0)
        except (ServerError, KeyError, AttributeError):
            return self._loaded.get(server, 0)

    def loaded_version(self, server: str) -> int:
        """The full-weight version a server holds right now (uncached; see `logged_version`)."""
        from flywheel.serving.vllm_client import weight_version

        return weight_version(server.rstrip("/"), timeout=2.0)

    def aliases(self) -> dict[str, int]:
        self.refresh()
        return {alias: slot.version for alias, slot in self._slots.items()}

    def snapshot(self) -> dict[str, Any]:
        """What route() answers from now, without refreshing: {"aliases": {alias: version}, "read_at": wall clock
        when that read began, None before the first}. Every route() after a snapshot whose read_at is later than an
        alias change routes by the change: how a caller learns that a cleared challenger gets no more sessions."""
        return {"aliases": {alias: slot.version for alias, slot in self._slots.items()}, "read_at": self._read_at}

    # -- routing --------------------------------------------------------------------------------
    def route(self, session_id: str) -> Route:
        """The version, served name and server for this session (sticky; cheap between refreshes)."""
        self.refresh()
        slots = self._slots
        champion = slots.get("champion", _Slot(0, "full"))
        challenger = slots.get("challenger")
        if challenger is not None and challenger.version == champion.version:
            challenger = None
        arm = arm_of(session_id, self.tier.challenger_share, challenger is not None, self.tier.control_share,
                     self.tier.spare_to_control)
        if arm == "control":
            slot = self._control_slot(slots)
        else:
            slot = challenger if arm == "challenger" and challenger is not None else champion
        return self._place(session_id, slot, arm, fallback=(champion.version, self.tier.control_version))

    def _control_slot(self, slots: dict[str, _Slot]) -> _Slot:
        version = self.tier.control_version
        if version == 0:
            return _Slot(0, "full")
        for slot in slots.values():  # a registered control version: its kind is known when an alias names it
            if slot.version == version:
                return slot
        return _Slot(version, self.tier.control_kind)

    def _place(self, session_id: str, slot: _Slot, arm: str, fallback: tuple[int, ...] = ()) -> Route:
        servers = list(self.tier.servers)
        if slot.kind == "lora" and slot.version != 0:
            server = servers[int(bucket("server:" + session_id) * len(servers))]
            return Route(version_name(slot.version), slot.version, "lora", arm, server)
        # no server holds the version (a reload in progress, a server down): the champion's servers, then the
        # control's, never just any server, which may hold an untested challenger
        holding: list[str] = []
        for version in (slot.version, *fallback):
            holding = holding or [s for s in servers if self._loaded.get(s, 0) == version]
        holding = holding or servers
        server = holding[int(bucket("server:" + session_id) * len(holding))]
        actual = self._loaded.get(server, 0)
        if actual != slot.version and (slot.version, actual) not in self._warned:
            self._warned.add((slot.version, actual))  # once per mismatch, not once per request
            log.warning("router: no server holds full policy-v%d for the %s; %s serves policy-v%d and is "
                        "logged as such",
                        slot.version, arm, server, actual)
        return Route(self.tier.base_served_name, actual, "full", arm, server)

    def shares(self) -> dict[int, float]:
        """policy version -> configured traffic share (for `flywheel status`)."""
        aliases = self.aliases()
        return shares(self.tier, aliases.get("champion", 0), aliases.get("challenger"))


def shares(tier: TierConfig, champion: int, challenger: int | None) -> dict[int, float]:
    """policy version -> the share of sessions its arms get (control and champion add up when they are one version)."""
    out: dict[int, float] = {}
    has_challenger = challenger is not None and challenger != champion
    spare = tier.challenger_share if has_challenger or tier.spare_to_control else 0.0  # not the champion's
    control = tier.control_share + (tier.challenger_share if tier.spare_to_control and not has_challenger else 0.0)
    out[tier.control_version] = out.get(tier.control_version, 0.0) + control
    out[champion] = out.get(champion, 0.0) + 1.0 - tier.control_share - spare
    if has_challenger and challenger is not None:
        out[challenger] = out.get(challenger, 0.0) + tier.challenger_share
    return {v: s for v, s in out.items() if s > 0}
