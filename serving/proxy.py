"""`flywheel proxy`: an OpenAI-compatible capture proxy in front of the vLLM tier.

    flywheel proxy --port 8100 --upstream http://127.0.0.1:8000

Where it sits: between the agents and the vLLM tier, at the start of the data flow.

    agent -> proxy -> the vLLM server flywheel.serving.router picks (champion or challenger)
               `-> one llm_call per choice -> flywheel.ingest.sdk.SessionLogger -> Kafka -> lake writer

It lives in serving/ because it routes (with --router serving the router decides which version
answers; the default static router sends every session to one model). It captures through the
same SDK an agent would embed, so it has no Kafka code of its own. It forwards only the OpenAI
routes below, never vLLM's admin endpoints (see flywheel.serving.vllm_client).

An agent changes only its base URL (to http://127.0.0.1:8100/v1) and sends a session id header;
the proxy forwards each request to vLLM with `return_token_ids` and `logprobs` switched on,
removes from the reply what the agent did not ask for, and logs one `llm_call` event per
choice with the exact prompt and completion token ids, the behaviour logprobs, the served
model name and the policy version (through the SessionLogger SDK, so a broker outage costs
the agent nothing).

Routes: POST /v1/chat/completions and /v1/completions (streaming and not), POST /v1/messages (Anthropic
Messages) and POST /v1/responses (OpenAI Responses), streaming and not, each translated to chat completions and
back (flywheel.serving.dialects; a Responses conversation continued by previous_response_id stays one session
without a session header, the proxy starting it and ending it at the idle timeout), GET /v1/models
(passed through), GET /health, GET /metrics (Prometheus text: flywheel_proxy_* and its SDK's delivery, see
docs/serving.md) and GET /stats (the same counters as JSON and, with the serving router, the aliases it routes by
and since when).

Headers (all optional; without a session id the request is forwarded but not logged):
  X-Flywheel-Session-Id        the session the call belongs to
  X-Flywheel-Agent-Id          the agent inside it (default "main")
  X-Flywheel-Parent-Agent-Id   its parent, for sub-agents
  X-Flywheel-Task-Type         task family, used when the proxy starts the session
  X-Flywheel-Session-Event     "start" (emit session_start before the call) or "end" (session_end after it);
                               a started session that sees no request for idle_timeout_s ends with
                               status idle_timeout
The agent does not choose the policy: the model name it sends is replaced by the routed one
(`route(session_id) -> Routed(served name, policy version, server)`; `--router serving` uses
flywheel.serving.router's sticky champion/challenger split), and the reply shows its own name back.
For a full-weight route the proxy reads the server's loaded version before and after the call. When they differ
(a reload during the call) the call is still logged, as policy_version the older of the two and policy_version_alt
the other: its tokens and behaviour logprobs are exact whichever served them, so the learner's importance
correction holds, and its staleness counts from the older version (counted as version_straddled). Only a call
whose server could not tell its version is left unlogged (version_unknown).
Authorization (or Anthropic's x-api-key, sent on as a bearer token) is forwarded to vLLM and never logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from flywheel.base import defaults
from flywheel.base.config import ConfigError, check_choices, load_config, setting, setup_logging
from flywheel.base.metrics import CONTENT_TYPE, Metrics, Reading
from flywheel.base.versions import FROZEN_VERSION, parse_version, version_name
from flywheel.ingest import schema
from flywheel.ingest.sdk import (
    HEADER_AGENT_ID,
    HEADER_PARENT_AGENT_ID,
    HEADER_SESSION_EVENT,
    HEADER_SESSION_ID,
    HEADER_TASK_TYPE,
    MAIN_AGENT,
    SessionLogger,
    default_journal_dir,
)
from flywheel.serving import dialects

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Routed:
    """Where one session's request goes and which policy version is logged for it."""

    model: str  # served model name sent to vLLM
    policy_version: int
    server: str | None = None  # vLLM base URL; None: the configured upstream
    loaded_version: Callable[[], int] | None = None  # full weights: read the server's version (before/after check)
    arm: str | None = None  # the router's arm (control, champion, challenger), logged on the llm_call


RouteFn = Callable[[str], Routed]
RouterState = Callable[[], dict[str, Any]]  # what a router routes with now (serving.router.Router.snapshot)

# The header names are defined once, in the SDK, whose Session.headers() sends them.
H_SESSION, H_AGENT, H_PARENT, H_TASK, H_EVENT = (HEADER_SESSION_ID, HEADER_AGENT_ID, HEADER_PARENT_AGENT_ID,
                                                  HEADER_TASK_TYPE, HEADER_SESSION_EVENT)
# Request parameters copied into the event's `sampling` (what the behaviour policy sampled with).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens", "n", "seed",
                 "stop", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
# An LLM call takes from tens of milliseconds (a short completion) to minutes (a long stream).
LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass
class ProxyConfig:
    """The capture proxy: where it listens, where vLLM is, where events go, how sessions are routed."""

    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8100, "port to listen on")
    upstream: str = setting(defaults.VLLM_URL, "the vLLM server (OpenAI-compatible) requests are forwarded to")
    kafka_bootstrap: str = setting(defaults.KAFKA_BOOTSTRAP, "Kafka the llm_call events go to")
    events_topic: str = setting(schema.EVENTS_TOPIC, "topic of the events")
    router: Literal["static", "serving"] = setting(
        "static", "static (every session -> static_model) or serving (serving.router.Router)")
    static_model: str = setting(version_name(0), "served model name for the static router")
    static_policy_version: int = setting(0, "policy version for the static router")
    idle_timeout_s: float = setting(300.0, "a session started through the proxy ends (idle_timeout) after this long "
                                           "without requests")
    log_completion_text: bool = setting(True, "log the completion text (redacted) next to the token ids")
    log_prompt_text: bool = setting(False, "log the rendered prompt text (redacted); token ids are always logged")
    upstream_timeout_s: float = setting(600.0, "longest a forwarded request may take")
    wire_format: Literal["json", "packed"] = setting(
        "packed", "how llm_calls travel (ingest/wire.py): packed (schema v3, token ids as base64 int32) or json "
                  "(v2, for a lake writer older than v3)")
    spool_name: str = setting("proxy",
                              "name of the SDK's spill spool (<FLYWHEEL_SPOOL_DIR or state dir>/<name>@<topic>), "
                              "stable so a restart replays it")
    journal: bool = setting(True, "write each logged call to a local journal before answering, so a SIGKILL of the "
                            "proxy loses no call it answered (beside the spool: "
                            "<root>/../journal/<spool_name>@<topic>)")
    heartbeat_s: float = setting(5.0, "how often the status heartbeat (var/run/status/proxy*.json) is "
                                      "written; 0: never")
    frozen_models: str = setting("", "models outside the router, as NAME=URL[,NAME=URL]: a request for model NAME goes "
                                     "to the server at URL, is logged with the session's arm and policy_version -1 "
                                     "(FROZEN_VERSION: on no learner's line, never trained). For frozen sub-agents "
                                     "(Kimi K2.5's PARL trains the orchestrator only; docs/swarm.md)")
    log_level: str = setting("INFO", "logging level")

    def check(self) -> None:
        check_choices(self)  # router, wire_format (ingest/wire.py FORMATS)
        if self.idle_timeout_s <= 0:
            raise ConfigError(f"idle_timeout_s: must be > 0, got {self.idle_timeout_s}")
        parse_frozen_models(self.frozen_models)


def parse_frozen_models(spec: str) -> dict[str, str]:
    """"sub=http://h:8003,b=http://h:8004" -> {"sub": "http://h:8003", "b": "http://h:8004"} (ConfigError: bad)."""
    out: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, sep, url = item.partition("=")
        if not sep or not name.strip() or not url.strip().startswith(("http://", "https://")):
            raise ConfigError(f"frozen_models: {item!r} is not NAME=http(s)://host:port")
        name, url = name.strip(), url.strip().rstrip("/")
        if parse_version(name) is not None:
            raise ConfigError(f"frozen_models: {name!r} is a policy version's name: every call to it would be frozen")
        if url.endswith("/v1"):
            raise ConfigError(f"frozen_models: {url!r}: give the server's root, without /v1 (the proxy appends it)")
        out[name] = url
    return out


def frozen_route(routed: Routed, model: str, url: str) -> Routed:
    """A call for a frozen model: its own server and served name, FROZEN_VERSION, the session's arm (the session
    stays in the arm the router gave it; only this call's weights are not the arm's)."""
    return Routed(model, FROZEN_VERSION, url, None, routed.arm)


def static_route(model: str, policy_version: int) -> RouteFn:
    """Every session to one served model (the default until serving.router is in use)."""
    fixed = Routed(model, policy_version)
    return lambda _session_id: fixed


def serving_route() -> tuple[RouteFn, RouterState]:
    """flywheel.serving.router.Router (config from FLYWHEEL_* like every process): champion/challenger, sticky per
    session; and its snapshot, which GET /stats shows under "router"."""
    try:
        from flywheel.serving import router as serving_router
    except ImportError as exc:
        raise ConfigError(f"router: serving.router is not importable ({exc}); use --router static") from exc
    router = serving_router.Router(load_config(serving_router.RouterConfig, [], prog="router"))

    def route(session_id: str) -> Routed:
        chosen = router.route(session_id)
        server = chosen.server or None
        exact = (lambda: router.loaded_version(server)) if chosen.kind == "full" and server else None
        return Routed(str(chosen.model), int(chosen.policy_version), server, exact, chosen.arm)

    return route, router.snapshot


@dataclass
class _SessionState:
    last_seen: float
    owned: bool = False  # the proxy emitted its session_start, so it also ends it
    ended: bool = False
    agent_id: str = MAIN_AGENT  # the agent that started it ends it
    parent_agent_id: str | None = None


@dataclass
class _Call:
    """What one forwarded request needs for its llm_call events."""

    kind: str  # "chat" | "completion" (a Messages request is captured as the chat call it becomes)
    session_id: str | None
    agent_id: str
    parent_agent_id: str | None
    model: str
    policy_version: int
    arm: str | None
    sampling: dict[str, Any]
    started: float
    wants_logprobs: bool
    wants_token_ids: bool
    wants_prompt_text: bool
    client_model: Any
    prompt_ids: dict[int, list[int]] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[float | None]] = field(default_factory=dict)
    texts: dict[int, list[str]] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    response_id: str | None = None
    prompt_text: str | None = None
    echo: bool = False
    version_before: int | None = None
    version_alt: int | None = None  # the other candidate, when the server's version changed during the call
    stops: list[str] = field(default_factory=list)  # the request's stop strings (a Messages reply names the one hit)
    reply_as: str | None = None  # "messages" | "responses": captured as chat, answered so (serving.dialects)
    original: dict[str, Any] = field(default_factory=dict)  # the request as the client sent it (reply_as set)
    translated: list[dict[str, Any]] = field(default_factory=list)  # the chat messages it became
    rid: str = field(default_factory=dialects.response_id)  # a Responses reply's id
    created: float = field(default_factory=time.time)
    session_key: str | None = None  # the session the request named (session_id is cleared for unloggable calls)


class CaptureProxy:
    """The request handlers and the session bookkeeping; the aiohttp app is built by make_app()."""

    def __init__(self, cfg: ProxyConfig, logger: SessionLogger, route: RouteFn,
                 router_state: RouterState | None = None) -> None:
        self.cfg = cfg
        self.logger = logger
        self.route = route
        self.router_state = router_state
        self.upstream = cfg.upstream.rstrip("/")
        self.frozen = parse_frozen_models(cfg.frozen_models)
        self.sessions: dict[str, _SessionState] = {}
        self.conversations = dialects.ResponseStore()  # what previous_response_id continues
        self.counters = {"requests": 0, "logged_calls": 0, "unlogged_no_session": 0, "upstream_errors": 0,
                         "bad_requests": 0, "log_errors": 0, "client_disconnects": 0, "idle_timeouts": 0,
                         "version_straddled": 0, "version_unknown": 0, "frozen_calls": 0}
        self._http: Any = None
        self.prom = Metrics("proxy")
        self.prom.read(self._readings)
        self.latency = self.prom.histogram("request_duration", "seconds", "forwarded request, first byte in to last "
                                           "byte out (a stream counts whole)", LATENCY_BUCKETS_S, labels=("route",))

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.cfg.upstream_timeout_s)
        # vLLM is on loopback or a private network; many concurrent agent sessions share the pool.
        self._http = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=256))

    async def stop(self) -> None:
        for session_id, state in list(self.sessions.items()):
            if state.owned and not state.ended:
                self._end(session_id, "proxy_shutdown")
        if self._http is not None:
            await self._http.close()

    async def heartbeat(self) -> None:
        """`flywheel status` shows the proxy's counters and its SDK's delivery state."""
        from flywheel.base.heartbeat import write_status

        name = "proxy" if self.cfg.port == ProxyConfig.port else f"proxy-{self.cfg.port}"
        while self.cfg.heartbeat_s > 0:
            sdk = self.logger.metrics()
            write_status(name, {**self.counters, "open_sessions": len(self.sessions), "upstream": self.upstream,
                                   "sent": sdk.get("sent"), "spool_records": sdk.get("spool_records"),
                                   "broker_down": sdk.get("broker_down")})
            await asyncio.sleep(self.cfg.heartbeat_s)

    async def reap_idle(self, interval_s: float | None = None) -> None:
        """End started sessions that went quiet; forget the others."""
        interval = interval_s or min(5.0, self.cfg.idle_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            self.reap_once(time.monotonic())

    def reap_once(self, now: float) -> None:
        for session_id, state in list(self.sessions.items()):
            if now - state.last_seen < self.cfg.idle_timeout_s:
                continue
            if state.owned and not state.ended:
                self._end(session_id, "idle_timeout")
                self.counters["idle_timeouts"] += 1
            self.sessions.pop(session_id, None)

    def _end(self, session_id: str, status: str) -> None:
        state = self.sessions.get(session_id)
        if state is not None:
            state.ended = True
            self.logger.attach(session_id, state.agent_id, state.parent_agent_id).end(status)
        else:
            self.logger.attach(session_id).end(status)

    # ---------------------------------------------------------------- handlers
    async def models(self, request: Any) -> Any:
        from aiohttp import web

        async with self._http.get(f"{self.upstream}/v1/models", headers=self._forward_headers(request)) as resp:
            body = await resp.read()
            return web.Response(status=resp.status, body=body, content_type=resp.content_type)

    async def health(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"ok": True})

    async def stats(self, request: Any) -> Any:
        from aiohttp import web

        router = self.router_state() if self.router_state is not None else None
        return web.json_response({**self.counters, "open_sessions": len(self.sessions), "sdk": self.logger.metrics(),
                                  "router": router})

    async def metrics(self, request: Any) -> Any:
        from aiohttp import web

        return web.Response(body=self.prom.exposition(), headers={"Content-Type": CONTENT_TYPE})

    def _readings(self) -> list[Reading]:
        """The counters GET /stats shows, for Prometheus (read at scrape time, see flywheel.base.metrics)."""
        c, sdk = dict(self.counters), self.logger.metrics()
        unlogged = {"no_session": c["unlogged_no_session"], "log_error": c["log_errors"],
                    "version_unknown": c["version_unknown"], "client_disconnect": c["client_disconnects"]}
        return [
            Reading("counter", "http", "requests", "completion requests received", c["requests"]),
            Reading("counter", "logged", "calls", "llm_call events handed to the SDK", c["logged_calls"]),
            Reading("counter", "straddled", "calls", "logged calls during which the server's version changed (logged "
                    "with both candidates)", c["version_straddled"]),
            Reading("counter", "unlogged", "calls", "answered calls not logged, by reason", unlogged, "reason"),
            Reading("counter", "upstream", "errors", "routing failures, upstream non-200s and broken upstreams",
                    c["upstream_errors"]),
            Reading("counter", "bad", "requests", "requests answered 400 (body not a JSON object)", c["bad_requests"]),
            Reading("counter", "idle_ended", "sessions", "started sessions ended by idle_timeout_s",
                    c["idle_timeouts"]),
            Reading("gauge", "open", "sessions", "sessions seen within idle_timeout_s", len(self.sessions)),
            Reading("counter", "sdk_sent", "records", "events the SDK delivered to Kafka", sdk.get("sent", 0)),
            Reading("counter", "sdk_dropped", "records", "events the SDK dropped (queue or spool full)",
                    sdk.get("dropped", 0)),
            Reading("gauge", "sdk_spool", "records", "events spilled to disk, waiting for the broker",
                    sdk.get("spool_records", 0)),
            Reading("gauge", "sdk_broker", "down", "1 while the SDK finds Kafka unreachable",
                    bool(sdk.get("broker_down"))),
        ]

    async def chat(self, request: Any) -> Any:
        return await self._timed(request, "chat", "/v1/chat/completions")

    async def completions(self, request: Any) -> Any:
        return await self._timed(request, "completion", "/v1/completions")

    async def messages(self, request: Any) -> Any:
        return await self._timed(request, "messages", "/v1/chat/completions")

    async def responses(self, request: Any) -> Any:
        return await self._timed(request, "responses", "/v1/chat/completions")

    async def _timed(self, request: Any, kind: str, path: str) -> Any:
        started = time.monotonic()
        try:
            return await self._proxy(request, kind, path)
        finally:
            self.latency.labels(kind).observe(time.monotonic() - started)

    async def _proxy(self, request: Any, kind: str, path: str) -> Any:
        import aiohttp
        from aiohttp import web

        self.counters["requests"] += 1
        started = time.monotonic()
        try:
            body = json.loads(await request.read())
            if not isinstance(body, dict):
                raise ValueError(f"expected a JSON object, got a JSON {type(body).__name__}")
        except ValueError as exc:
            self.counters["bad_requests"] += 1
            return _error(400, f"request body is not valid JSON: {exc}", kind)
        original, who, dialect = body, request, kind
        if kind in ("messages", "responses"):  # captured as the chat call it becomes, answered in its own format
            try:
                body, who = translate(kind, body, request, self.conversations)
            except (ValueError, LookupError) as exc:
                self.counters["bad_requests"] += 1
                return _error(404 if isinstance(exc, LookupError) else 400, f"{kind} request: {exc}", kind)
            kind = "chat"
        loop = asyncio.get_running_loop()
        session_id = who.headers.get(H_SESSION) or ""
        try:  # the router may read the registry or probe servers: never on the event loop
            routed = self._unless_frozen(await loop.run_in_executor(None, self.route, session_id), body)
        except Exception as exc:
            self.counters["upstream_errors"] += 1
            log.warning("proxy: routing session %r failed (%s); answered 503", session_id, exc)
            return _error(503, f"no policy route for this session: {exc}", dialect)
        call = self._begin(who, kind, body, started, routed)
        if dialect != kind:
            call.reply_as, call.original, call.client_model = dialect, original, original.get("model")
            call.translated = body["messages"]
        if routed.loaded_version is not None:
            call.version_before = await self._loaded_version(routed)
        upstream_body = self._upstream_body(kind, body, call)
        headers = self._forward_headers(request)
        url = f"{(routed.server or self.upstream).rstrip('/')}{path}"
        try:
            if body.get("stream"):
                return await self._stream(request, who, url, upstream_body, headers, call, routed)
            async with self._http.post(url, json=upstream_body, headers=headers) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    self.counters["upstream_errors"] += 1
                    return _upstream_error(resp.status, raw, resp.content_type, call.reply_as)
                payload = json.loads(raw)  # a 200 that is not JSON is an upstream failure too (ValueError)
        except (OSError, asyncio.TimeoutError, aiohttp.ClientError, ValueError) as exc:
            self.counters["upstream_errors"] += 1
            log.warning("proxy: upstream %s failed (%s); answered 502", url, exc)
            return _error(502, f"upstream {url} unavailable: {exc}", call.reply_as or kind)
        collect(call, payload, streaming=False)
        await self._check_version(call, routed)
        self._log(call)
        self._after(who, call)
        if call.reply_as is not None:
            return web.json_response(translated_reply(call, payload, self.conversations))
        strip(call, payload, streaming=False)
        return web.json_response(payload)

    def _unless_frozen(self, routed: Routed, body: dict[str, Any]) -> Routed:
        """The route of a request for one of frozen_models: that model's server, FROZEN_VERSION, the arm the router
        gave the session (so the router still routes every request, frozen or not)."""
        url = self.frozen.get(str(body.get("model") or ""))
        if url is None:
            return routed
        self.counters["frozen_calls"] += 1
        return frozen_route(routed, str(body["model"]), url)

    async def _loaded_version(self, routed: Routed) -> int | None:
        assert routed.loaded_version is not None
        try:
            return await asyncio.get_running_loop().run_in_executor(None, routed.loaded_version)
        except Exception as exc:
            log.warning("proxy: cannot read the loaded version of %s (%s)", routed.server, exc)
            return None

    async def _check_version(self, call: _Call, routed: Routed) -> None:
        """Full weights can be replaced under one served name: the version(s) that may have served the call."""
        if routed.loaded_version is None:
            return
        after, before = await self._loaded_version(routed), call.version_before
        if before is None or after is None:
            self.counters["version_unknown"] += 1
            log.warning("proxy: session %s: %s could not tell its loaded version (before %s, after %s); "
                        "llm_call not logged", call.session_id, routed.server, before, after)
            call.session_id = None  # nothing is logged for it
            return
        call.policy_version = min(before, after)  # the older: staleness counts from it
        if after != before:
            self.counters["version_straddled"] += 1
            call.version_alt = max(before, after)
            log.info("proxy: session %s: %s held policy-v%d before and policy-v%d after the call; logged as "
                     "policy-v%d with policy_version_alt %d", call.session_id, routed.server, before, after,
                     call.policy_version, call.version_alt)

    async def _stream(self, request: Any, who: Any, url: str, upstream_body: dict[str, Any], headers: dict[str, str],
                      call: _Call, routed: Routed) -> Any:
        import aiohttp
        from aiohttp import web

        async with self._http.post(url, json=upstream_body, headers=headers) as resp:
            if resp.status != 200:
                self.counters["upstream_errors"] += 1
                return _upstream_error(resp.status, await resp.read(), resp.content_type, call.reply_as)
            translator = stream_translator(call)
            out = web.StreamResponse(status=200,
                                     headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await out.prepare(request)
            complete = False
            try:
                async for line in resp.content:
                    if request.transport is None or request.transport.is_closing():
                        raise ConnectionResetError("client closed the stream")
                    text = line.decode("utf-8", "replace").strip()
                    if not text.startswith("data:"):
                        continue
                    data = text[len("data:"):].strip()
                    if data == "[DONE]":
                        complete = True
                        await out.write(b"".join(translator.finish()) if translator else b"data: [DONE]\n\n")
                        continue
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        await out.write(f"data: {data}\n\n".encode())
                        continue
                    if isinstance(chunk, dict) and "choices" in chunk:
                        collect(call, chunk, streaming=True)
                        if translator is not None:
                            await out.write(b"".join(translator.feed(chunk)))
                            continue
                        strip(call, chunk, streaming=True)
                    await out.write(f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n".encode())
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                self.counters["upstream_errors"] += 1
                log.warning("proxy: upstream stream from %s broke (%s); the agent's stream ends here, nothing logged",
                            url, exc)
                return out
            except ConnectionResetError:
                # The agent went away mid-stream. Tokens it never received are not its behaviour, but a
                # stream that already finished (the agent closes right after [DONE]) is logged as usual.
                if not (complete or call.finish):
                    self.counters["client_disconnects"] += 1
                    return out
            if complete or call.finish:
                await self._check_version(call, routed)
                self._log(call)
            if complete and isinstance(translator, dialects.ResponsesStream) and translator.reply is not None:
                remember(call, translator.reply, self.conversations)
            self._after(who, call)
            try:
                await out.write_eof()
            except ConnectionResetError:
                pass
            return out

    # ---------------------------------------------------------------- request side
    def _begin(self, request: Any, kind: str, body: dict[str, Any], started: float, routed: Routed) -> _Call:
        h = request.headers
        session_id = h.get(H_SESSION) or None
        agent_id = h.get(H_AGENT) or MAIN_AGENT
        model, version = routed.model, routed.policy_version
        call = _Call(
            kind=kind, session_id=session_id, agent_id=agent_id, parent_agent_id=h.get(H_PARENT) or None,
            model=model, policy_version=version, arm=routed.arm, started=started,
            sampling={k: body[k] for k in SAMPLING_KEYS if body.get(k) is not None},
            wants_logprobs=bool(body.get("logprobs")) if kind == "chat" else body.get("logprobs") is not None,
            wants_token_ids=bool(body.get("return_token_ids")), wants_prompt_text=bool(body.get("return_prompt_text")),
            client_model=body.get("model"),
            echo=bool(body.get("echo")),
            stops=[x for x in ([body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop") or [])],
        )
        call.session_key = session_id
        if session_id is None:
            self.counters["unlogged_no_session"] += 1
            return call
        state = self.sessions.get(session_id)
        if state is None:
            state = self.sessions[session_id] = _SessionState(last_seen=started)
        state.last_seen = started
        if (h.get(H_EVENT) or "").lower() == "start" and not state.owned:
            state.owned, state.ended = True, False
            state.agent_id, state.parent_agent_id = agent_id, call.parent_agent_id
            self.logger.attach(session_id, agent_id, call.parent_agent_id).start(h.get(H_TASK) or "unknown")
        return call

    def _after(self, request: Any, call: _Call) -> None:
        session_id = call.session_key
        if session_id is None:
            return
        state = self.sessions.get(session_id)
        if state is not None:
            state.last_seen = time.monotonic()  # a long stream is activity too: not idle while it runs
        if (request.headers.get(H_EVENT) or "").lower() == "end" and (state is None or not state.ended):
            self._end(session_id, "ok")

    def _upstream_body(self, kind: str, body: dict[str, Any], call: _Call) -> dict[str, Any]:
        out = dict(body)
        out["model"] = call.model
        out["return_token_ids"] = True
        if kind == "chat":
            out["logprobs"] = True  # the sampled token's logprob; top_logprobs stays what the agent asked
            if self.cfg.log_prompt_text:
                out["return_prompt_text"] = True
        elif body.get("logprobs") is None:
            out["logprobs"] = 0  # completions: 0 alternatives, the sampled token's logprob only
        return out

    @staticmethod
    def _forward_headers(request: Any) -> dict[str, str]:
        # Only what vLLM needs; X-Flywheel-* stay here, Authorization goes upstream (and nowhere else). An
        # Anthropic client's x-api-key is its bearer token: vLLM's --api-key reads Authorization.
        out = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "accept")}
        key = request.headers.get("x-api-key")
        if key and not any(k.lower() == "authorization" for k in out):
            out["Authorization"] = f"Bearer {key}"
        return out

    def _log(self, call: _Call) -> None:
        if call.session_id is None:
            return
        session = self.logger.attach(call.session_id, call.agent_id, call.parent_agent_id)
        latency = time.monotonic() - call.started
        group = call.response_id if len(call.token_ids) > 1 else None
        for i, completion in sorted(call.token_ids.items()):
            prompt = call.prompt_ids.get(i, call.prompt_ids.get(-1))
            logprobs = call.logprobs.get(i, [])
            if call.echo and len(logprobs) > len(completion):
                logprobs = logprobs[-len(completion):] if completion else []  # echo prefixes prompt logprobs
            if prompt is None or len(logprobs) != len(completion) or any(x is None for x in logprobs):
                self.counters["log_errors"] += 1
                log.warning("proxy: session %s choice %d: vLLM returned %s prompt ids, %d token ids and %d logprobs; "
                            "llm_call not logged", call.session_id, i, "no" if prompt is None else len(prompt),
                            len(completion), len(logprobs))
                continue
            session.llm_call(
                model=call.model, policy_version=call.policy_version, prompt_token_ids=prompt,
                completion_token_ids=completion, completion_logprobs=[float(x) for x in logprobs if x is not None],
                finish_reason=call.finish.get(i), latency_s=latency, sampling=call.sampling or None, group_id=group,
                request_id=call.response_id, arm=call.arm, policy_version_alt=call.version_alt,
                prompt_text=call.prompt_text if self.cfg.log_prompt_text else None,
                completion_text="".join(call.texts.get(i, [])) if self.cfg.log_completion_text else None,
            )
            self.counters["logged_calls"] += 1

def collect(call: _Call, payload: dict[str, Any], streaming: bool) -> None:
    """Add a reply (or one stream chunk) to the call: prompt and completion ids, logprobs, text, finish."""
    # the id its client got: a Responses reply's own (resp_...), which previous_response_id names; else vLLM's
    call.response_id = call.response_id or (call.rid if call.reply_as == "responses" else payload.get("id"))
    if call.kind == "chat" and payload.get("prompt_token_ids") is not None:
        for choice in payload.get("choices") or [{"index": 0}]:
            call.prompt_ids[int(choice.get("index", 0))] = list(payload["prompt_token_ids"])
        call.prompt_ids.setdefault(-1, list(payload["prompt_token_ids"]))  # n>1: later choices reuse it
    if payload.get("prompt_text") and call.prompt_text is None:
        call.prompt_text = payload["prompt_text"]
    for choice in payload.get("choices") or []:
        i = int(choice.get("index", 0))
        if call.kind == "completion" and choice.get("prompt_token_ids") is not None:
            call.prompt_ids[i] = list(choice["prompt_token_ids"])
        if choice.get("token_ids") is not None:
            call.token_ids.setdefault(i, []).extend(choice["token_ids"])
        lp = choice.get("logprobs")
        if lp:
            if call.kind == "chat":
                call.logprobs.setdefault(i, []).extend(c.get("logprob") for c in lp.get("content") or [])
            else:
                call.logprobs.setdefault(i, []).extend(lp.get("token_logprobs") or [])
        if call.kind == "chat":
            message = choice.get("delta" if streaming else "message") or {}
            text = message.get("content")
            if text is None and message.get("tool_calls"):
                text = json.dumps(message["tool_calls"])
        else:
            text = choice.get("text")
        if text:
            call.texts.setdefault(i, []).append(text)
        if choice.get("finish_reason") is not None:
            call.finish[i] = choice["finish_reason"]


def strip(call: _Call, payload: dict[str, Any], streaming: bool) -> None:
    """Give the agent back the reply it asked for: its model name, no extras it did not request."""
    if call.client_model is not None and "model" in payload:
        payload["model"] = call.client_model
    if not call.wants_token_ids:
        _drop(payload, "prompt_token_ids", streaming)
        for choice in payload.get("choices") or []:
            _drop(choice, "token_ids", streaming)
            _drop(choice, "prompt_token_ids", streaming)
    if not call.wants_logprobs:
        for choice in payload.get("choices") or []:
            if "logprobs" in choice:
                choice["logprobs"] = None
    if not call.wants_prompt_text:
        _drop(payload, "prompt_text", streaming)


def _drop(obj: dict[str, Any], key: str, streaming: bool) -> None:
    # vLLM leaves unrequested fields out of stream chunks and null in whole responses: mimic both.
    if key in obj:
        if streaming:
            del obj[key]
        else:
            obj[key] = None


class _Headed:
    """Request headers as the proxy reads them for a session (a Responses conversation's derived session id)."""

    def __init__(self, headers: Any) -> None:
        self.headers = headers


def translate(kind: str, body: dict[str, Any], request: Any, conversations: dialects.ResponseStore
              ) -> tuple[dict[str, Any], Any]:
    """(the chat request, what to read the session headers from) for a Messages or Responses request.

    A Responses request names its session by header, or by the previous response it continues; a first one
    without a header opens a session of its own, which the proxy starts (and the idle timeout ends).
    ValueError: the body cannot be translated; LookupError: previous_response_id is not known here."""
    if kind == "messages":
        return dialects.messages_request(body), request
    from multidict import CIMultiDict

    headers: CIMultiDict[str] = CIMultiDict(request.headers)
    history: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous:
        kept = conversations.get(str(previous))
        if kept is None:
            raise LookupError(f"previous_response_id {previous!r} is not known to this proxy (it keeps the last "
                              f"{conversations.capacity} responses in memory, and none from before a restart)")
        session_id, history = kept
        headers.setdefault(H_SESSION, session_id)
    elif not headers.get(H_SESSION):
        headers[H_SESSION] = f"resp-{uuid.uuid4().hex}"
        headers.setdefault(H_EVENT, "start")
    return dialects.responses_request(body, history), _Headed(headers)


def translated_reply(call: _Call, payload: dict[str, Any], conversations: dialects.ResponseStore) -> dict[str, Any]:
    """A whole chat completion as the reply the client's format expects."""
    if call.reply_as == "messages":
        return dialects.messages_reply(payload, call.client_model, call.stops)
    reply = dialects.responses_reply(payload, call.original, call.rid, call.created)
    remember(call, reply, conversations)
    return reply


def stream_translator(call: _Call) -> dialects.MessagesStream | dialects.ResponsesStream | None:
    if call.reply_as == "messages":
        return dialects.MessagesStream(call.client_model, call.stops)
    if call.reply_as == "responses":
        return dialects.ResponsesStream(call.original, call.rid, call.created)
    return None


def remember(call: _Call, reply: dict[str, Any], conversations: dialects.ResponseStore) -> None:
    """Keep a Responses conversation for a follow-up (store defaults to true, as in the Responses API)."""
    if call.original.get("store", True) is False or call.session_key is None:
        return
    history = call.translated[1:] if call.original.get("instructions") else call.translated  # not carried on
    conversations.put(call.rid, call.session_key, history + dialects.reply_messages(reply))


def _error(status: int, message: str, kind: str = "chat") -> Any:
    """An error in the format the client speaks: OpenAI's, or Anthropic's for /v1/messages."""
    from aiohttp import web

    if kind == "messages":
        return web.json_response(dialects.messages_error(status, message), status=status)
    return web.json_response({"error": {"message": message, "type": "invalid_request_error", "code": status}},
                             status=status)


def _upstream_error(status: int, raw: bytes, content_type: str, reply_as: str | None) -> Any:
    """vLLM's error reply: passed through as it is, or, for a translated request, its message in that format."""
    from aiohttp import web

    if reply_as is None:
        return web.Response(status=status, body=raw, content_type=content_type)
    try:
        detail = json.loads(raw)
        message = str((detail.get("error") or {}).get("message") or detail) if isinstance(detail, dict) else str(detail)
    except ValueError:
        message = raw.decode("utf-8", "replace")[:2000]
    return _error(status, f"upstream: {message}", reply_as)


def make_app(proxy: CaptureProxy) -> Any:
    """The aiohttp application: routes, and start/stop of the upstream client and the idle reaper."""
    from aiohttp import web

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", proxy.chat)
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_post("/v1/messages", proxy.messages)
    app.router.add_post("/v1/responses", proxy.responses)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/metrics", proxy.metrics)
    app.router.add_get("/stats", proxy.stats)

    async def on_startup(_app: Any) -> None:
        await proxy.start()
        loop = asyncio.get_running_loop()
        _app["tasks"] = [loop.create_task(proxy.reap_idle()), loop.create_task(proxy.heartbeat())]

    async def on_cleanup(_app: Any) -> None:
        for task in _app["tasks"]:
            task.cancel()
        await proxy.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def build_route(cfg: ProxyConfig) -> tuple[RouteFn, RouterState | None]:
    if cfg.router == "serving":
        return serving_route()
    return static_route(cfg.static_model, cfg.static_policy_version), None


def run(cfg: ProxyConfig) -> int:
    from aiohttp import web

    route, router_state = build_route(cfg)
    log.info("proxy: routing with %s (%s)", cfg.router,
             route("") if cfg.router == "static" else "flywheel.serving.router.Router")
    journal = default_journal_dir(cfg.spool_name, cfg.events_topic) if cfg.journal else None
    logger = SessionLogger(cfg.kafka_bootstrap, topic=cfg.events_topic, name=cfg.spool_name,
                           wire_format=cfg.wire_format, journal_dir=journal)
    log.info("proxy: logging llm_call events to %s on %s", cfg.events_topic, cfg.kafka_bootstrap)
    proxy = CaptureProxy(cfg, logger, route, router_state)
    log.info("proxy: listening on http://%s:%d/v1, forwarding to %s", cfg.host, cfg.port, cfg.upstream)
    try:
        # run_app handles SIGINT/SIGTERM: it stops accepting, finishes cleanup (on_cleanup ends open sessions).
        web.run_app(make_app(proxy), host=cfg.host, port=cfg.port, print=None, access_log=None)
    finally:
        logger.close(timeout=10)
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg = load_config(ProxyConfig, argv, prog="flywheel proxy")
    setup_logging(cfg.log_level)
    return run(cfg)
