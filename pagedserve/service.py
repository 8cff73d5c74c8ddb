"""What every gRPC service process shares: channels, a server with the standard health service, transport
security (TLS, mutual TLS), the internal shared secret, public API keys, and serving until SIGTERM or SIGINT."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import hmac
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Protocol

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pagedserve.config import API_KEY_ENV, INTERNAL_TOKEN_ENV, PARENT_PID_ENV, format_cpu_list, parse_cpu_list

logger = logging.getLogger(__name__)

# Between services a step of a long context and a big batch is larger than gRPC's 4 MiB default. The
# public port has its own, smaller limit (ServingConfig.max_message_bytes).
INTERNAL_MAX_MESSAGE_BYTES = 256 << 20
# The internal secret travels in this metadata key; `pagedserve up` hands it to its services in
# INTERNAL_TOKEN_ENV, never on the command line.
TOKEN_METADATA_KEY = "x-pagedserve-token"
# A service whose launcher (PARENT_PID_ENV) is gone, killed with SIGKILL, which it cannot pass on, shuts
# down rather than run on as an orphan nobody supervises; it looks this often.
PARENT_POLL_S = 1.0
# Health stays open: load balancers, compose and the launcher probe it without credentials.
HEALTH_PREFIX = "/grpc.health.v1.Health/"
# A dependency's health comes pushed over a Health.Watch stream; one that breaks is opened again this often.
HEALTH_POLL_S = 0.5
# A Check this often, given HEALTH_TIMEOUT_S to answer, backs the streams up: a dependency that hangs keeps
# its stream open but answers nothing.
HEALTH_CHECK_EVERY_S = 5.0
HEALTH_TIMEOUT_S = 0.5
# The health service name of a liveness probe: SERVING from start to exit, a drain included. The overall
# health ("", what readiness asks) also turns NOT_SERVING while a dependency is down or the service drains,
# and a liveness probe on it would restart a healthy process for its neighbour's outage.
LIVENESS_SERVICE = "liveness"
# While draining, how often the service looks whether its requests in flight are done.
DRAIN_POLL_S = 0.05


def _options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # A peer that restarts is found again within a second (gRPC's own backoff grows to two minutes).
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


@dataclasses.dataclass(frozen=True)
class Security:
    """A process's credentials. cert/key: the certificate every server presents (and internal channels
    present as client certificate); ca: the CA of the services' certificates (with it, channels verify
    servers against it and internal servers require client certificates it signed); client_ca: on the
    public port, require client certificates signed by it (or by ca); internal_token: the shared secret of
    internal RPCs; api_keys: the keys the public API accepts (none: open)."""

    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None
    client_ca: bytes | None = None
    internal_token: str | None = None
    api_keys: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, serving, environ=os.environ) -> "Security":
        """From a ServingConfig; the internal token from its file or else the environment, API keys (one a
        line) from their file and the environment."""
        token = (Path(serving.internal_token_file).read_text().strip() if serving.internal_token_file
                 else environ.get(INTERNAL_TOKEN_ENV) or None)
        keys = Path(serving.api_key_file).read_text().split() if serving.api_key_file else []
        if environ.get(API_KEY_ENV):
            keys.append(environ[API_KEY_ENV])
        return cls(cert=_read(serving.tls_cert), key=_read(serving.tls_key), ca=_read(serving.tls_ca),
                   client_ca=_read(serving.tls_client_ca), internal_token=token, api_keys=tuple(keys))

    def api_key_ok(self, authorization: str) -> bool:
        """Whether an `authorization` header value carries one of the API keys (always, when there are none)."""
        return not self.api_keys or _bearer_ok({"authorization": authorization}, self.api_keys)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if self.cert is None:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def server_credentials(self, public: bool) -> grpc.ServerCredentials | None:
        if self.cert is None:
            return None
        if not public:
            roots = self.ca
        elif self.client_ca:
            # The public port also takes the services' own certificates, so that the launcher can probe it.
            roots = b"\n".join(c for c in (self.client_ca, self.ca) if c)
        else:
            roots = None
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=roots,
                                           require_client_auth=roots is not None)



def channel(address: str, security: Security | None = None,
            max_message_bytes: int = INTERNAL_MAX_MESSAGE_BYTES) -> grpc.Channel:
    """An internal channel: TLS when the security has a certificate, the internal token on every call."""
    security = security or Security()
    credentials = security.channel_credentials()
    options = _options(max_message_bytes)
    ch = (grpc.secure_channel(address, credentials, options=options) if credentials
          else grpc.insecure_channel(address, options=options))
    if security.internal_token:
        ch = grpc.intercept_channel(ch, _AddMetadata([(TOKEN_METADATA_KEY, security.internal_token)]))
    return ch


def client_channel(address: str, *, api_key: str | None = None, tls_ca: str | None = None,
                   tls_cert: str | None = None, tls_key: str | None = None,
                   max_message_bytes: int = INTERNAL_MAX_MESSAGE_BYTES) -> grpc.Channel:
    """A channel to the public API: TLS with a CA file (plus a client certificate for mutual TLS), and the
    API key as `authorization: Bearer`."""
    options = _options(max_message_bytes)
    if tls_ca or tls_cert:
        credentials = grpc.ssl_channel_credentials(root_certificates=_read(tls_ca), private_key=_read(tls_key),
                                                   certificate_chain=_read(tls_cert))
        ch = grpc.secure_channel(address, credentials, options=options)
    else:
        ch = grpc.insecure_channel(address, options=options)
    if api_key:
        ch = grpc.intercept_channel(ch, _AddMetadata([("authorization", f"Bearer {api_key}")]))
    return ch


class _AddMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        self.pairs = pairs

    def _details(self, details):
        return details._replace(metadata=[*(details.metadata or ()), *self.pairs])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def wait_until_serving(address: str, timeout: float, security: Security | None = None) -> None:
    """Blocks until the server at address answers its health check with SERVING."""
    with channel(address, security) as ch:
        grpc.channel_ready_future(ch).result(timeout=timeout)
        health_check = health_pb2_grpc.HealthStub(ch)
        status = health_check.Check(health_pb2.HealthCheckRequest(), timeout=timeout, wait_for_ready=True).status
        if status != health_pb2.HealthCheckResponse.SERVING:
            raise RuntimeError(f"{address} is not serving (status {status})")


class DependencyWatcher:
    """Follows the health of the services this one needs and reports whether all of them are SERVING. A
    dependency that is down, unreachable or NOT_SERVING itself (one of its own is down) counts as down, so the
    state travels up the chain to the frontend.

    Each dependency's status comes over a Health.Watch stream, on a thread of its own: a change is seen as the
    dependency makes it, a process that dies breaks its stream at once, and nothing is polled while all is
    well (polling each dependency twice a second would cost each service about 4 ms of CPU a second, taken
    from the cores an executor computes on). After the first Check at start, only a Watch answer makes a
    dependency SERVING; a stream that breaks, or a backstop Check that fails, makes it down until a new stream
    answers."""

    def __init__(self, dependencies: dict[str, str], on_change, security: Security) -> None:
        """dependencies: {name: address}; on_change(healthy: bool, down: list[str]) after every change."""
        self.channels = {name: channel(address, security) for name, address in dependencies.items()}
        self.stubs = {name: health_pb2_grpc.HealthStub(ch) for name, ch in self.channels.items()}
        self.on_change = on_change
        self.serving = dict.fromkeys(self.stubs, False)
        self.down: list[str] | None = None
        self.lock = threading.Lock()  # orders the changes and their reports
        self.streams: dict[str, grpc.Call] = {}
        self.stopped = threading.Event()
        self.threads = [threading.Thread(target=self._follow, args=(name,), name=f"watch-{name}", daemon=True)
                        for name in self.stubs]
        self.threads.append(threading.Thread(target=self._backstop, name="dependency-health", daemon=True))

    def check(self) -> None:
        """Asks every dependency once (Check), and reports once for all of them."""
        self._set({name: self._serving(stub) for name, stub in self.stubs.items()})

    @staticmethod
    def _serving(stub) -> bool:
        try:
            status = stub.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S).status
        except grpc.RpcError:
            return False
        return status == health_pb2.HealthCheckResponse.SERVING

    def _set(self, serving: dict[str, bool]) -> None:
        with self.lock:
            self.serving.update(serving)
            down = [n for n, up in self.serving.items() if not up]
            if down != self.down:
                self.down = down
                self.on_change(not down, down)

    def start(self) -> None:
        self.check()
        for thread in self.threads:
            thread.start()

    def _follow(self, name: str) -> None:
        while not self.stopped.is_set():
            stream = self.stubs[name].Watch(health_pb2.HealthCheckRequest())
            with self.lock:
                self.streams[name] = stream
            if self.stopped.is_set():  # stop() may have cancelled the streams before this one was listed
                stream.cancel()
            try:
                for response in stream:
                    self._set({name: response.status == health_pb2.HealthCheckResponse.SERVING})
            except grpc.RpcError:
                pass
            if self.stopped.is_set():
                return
            self._set({name: False})
            self.stopped.wait(HEALTH_POLL_S)

    def _backstop(self) -> None:
        while not self.stopped.wait(HEALTH_CHECK_EVERY_S):
            for name, stub in self.stubs.items():
                if not self._serving(stub):
                    self._set({name: False})
                    with self.lock:
                        stream = self.streams.get(name)
                    if stream is not None:
                        stream.cancel()  # its thread opens a new one, which must answer to make it SERVING

    def stop(self) -> None:
        self.stopped.set()
        with self.lock:
            streams = list(self.streams.values())
        for stream in streams:
            stream.cancel()
        for thread in self.threads:
            if thread.is_alive():
                thread.join()
        for ch in self.channels.values():
            ch.close()


# ---------------------------------------------------------------------------------------------- the gate
class _Undecodable:
    """What the request deserializer hands on instead of raising: gRPC would answer INTERNAL and log a
    traceback per request."""


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str,
             aio: bool) -> grpc.RpcMethodHandler:
    """A handler of the same shape that answers code without decoding the request."""
    if aio:
        async def refuse(request, context):
            await context.abort(code, message)
    else:
        def refuse(request, context):
            context.abort(code, message)

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(refuse, response_serializer=handler.response_serializer)


def _decode_quietly(handler: grpc.RpcMethodHandler, method: str, aio: bool) -> grpc.RpcMethodHandler:
    """A unary-request handler whose undecodable request (not a message of its type, or a string field that
    is not valid UTF-8) gets INVALID_ARGUMENT. Streaming requests are internal only and keep gRPC's answer.
    aio: the handler's behaviour is a coroutine function or, streaming responses, an async generator one."""
    if handler.request_streaming or handler.request_deserializer is None:
        return handler
    deserialize = handler.request_deserializer

    def safe_deserialize(data: bytes):
        try:
            return deserialize(data)
        except Exception:  # protobuf's DecodeError; what it says does not name the field either
            return _Undecodable()

    behavior_name = "unary_stream" if handler.response_streaming else "unary_unary"
    behavior = getattr(handler, behavior_name)
    undecodable = (grpc.StatusCode.INVALID_ARGUMENT,
                   f"{method}: the request is not a valid protobuf message of its type (a malformed message, or "
                   "a string field such as prompt or stop that is not valid UTF-8)")

    if not aio:
        def checked(request, context):
            if isinstance(request, _Undecodable):
                context.abort(*undecodable)
            return behavior(request, context)
    elif handler.response_streaming:
        async def checked(request, context):
            if isinstance(request, _Undecodable):
                await context.abort(*undecodable)
            # Closed with this one, so that the call's own clean-up runs when the client goes away.
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response
    else:
        async def checked(request, context):
            if isinstance(request, _Undecodable):
                await context.abort(*undecodable)
            return await behavior(request, context)

    return handler._replace(request_deserializer=safe_deserialize, **{behavior_name: checked})


def _bearer_ok(metadata: dict[str, str], keys: tuple[str, ...]) -> bool:
    given = metadata.get("authorization", "")
    scheme, _, key = given.partition(" ")
    if scheme.lower() != "bearer":
        return False
    # Compare with every key, in constant time each, so the timing says nothing about which one is near.
    found = False
    for expected in keys:
        found |= hmac.compare_digest(key.encode(), expected.encode())
    return found


class _Gate(grpc.ServerInterceptor):
    """Every call but health: the internal token (internal servers) or an API key (the public one), then
    quiet decoding."""

    aio = False

    def __init__(self, security: Security, public: bool) -> None:
        self.security = security
        self.public = public

    def _refused(self, metadata: dict[str, str]) -> str | None:
        if self.public:
            if self.security.api_keys and not _bearer_ok(metadata, self.security.api_keys):
                return "a valid API key is required (authorization: Bearer <key>)"
        elif self.security.internal_token:
            given = metadata.get(TOKEN_METADATA_KEY, "")
            if not hmac.compare_digest(given.encode(), self.security.internal_token.encode()):
                return "internal RPCs need this deployment's internal token"
        return None

    def _gated(self, handler: grpc.RpcMethodHandler | None, details) -> grpc.RpcMethodHandler | None:
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        refused = self._refused(dict(details.invocation_metadata or ()))
        if refused:
            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED, refused, self.aio)
        return _decode_quietly(handler, details.method, self.aio)

    def intercept_service(self, continuation, details):
        return self._gated(continuation(details), details)


class _AioGate(_Gate, grpc.aio.ServerInterceptor):
    """The gate of an asyncio server: the same decisions, async handlers."""

    aio = True

    async def intercept_service(self, continuation, details):
        return self._gated(await continuation(details), details)


class Drainable(Protocol):
    """What a service that drains on SIGTERM provides: refuse new requests from now on; whether the
    requests in flight are all done."""

    def start_draining(self) -> None: ...

    def idle(self) -> bool: ...


class Service:
    """A gRPC server with the health service: SERVING once start() has returned, and while every one of
    its dependencies ({name: address}) is SERVING and it is not draining.

    public: the client-facing port (API keys, client CA, the public message size limit); otherwise an
    internal one (the internal token, mutual TLS with the services' CA)."""

    def __init__(self, name: str, host: str, port: int, max_workers: int = 16, *,
                 security: Security | None = None, public: bool = False,
                 max_message_bytes: int = INTERNAL_MAX_MESSAGE_BYTES,
                 dependencies: dict[str, str] | None = None) -> None:
        self.name = name
        security = security or Security()
        self.watcher = (DependencyWatcher(dependencies, self._dependencies_changed, security)
                        if dependencies else None)
        # gRPC turns SO_REUSEPORT on by default: a second server could then share a port already in use.
        options = [*_options(max_message_bytes), ("grpc.so_reuseport", 0)]
        credentials = security.server_credentials(public)
        self.server, self.health = self._make_server(options, security, public, max_workers)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        try:
            self.port = (self.server.add_secure_port(f"{host}:{port}", credentials) if credentials
                         else self.server.add_insecure_port(f"{host}:{port}"))
        except RuntimeError:  # recent gRPC raises where older ones returned 0
            self.port = 0
        if self.port == 0:
            raise RuntimeError(f"{name}: cannot listen on {host}:{port} (in use, or not an address of this host)")
        self.address = f"{host}:{self.port}"
        self.tls = credentials is not None
        self.draining = False
        self.health_lock = threading.Lock()  # a dependency's change must not undo the drain's NOT_SERVING

    @staticmethod
    def _make_server(options, security: Security, public: bool, max_workers: int):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=options,
                             interceptors=[_Gate(security, public)])
        return server, health.HealthServicer()

    def _start_server(self) -> None:
        self.server.start()

    def _set_health(self, service: str, status) -> None:
        self.health.set(service, status)

    def _stop_server(self, grace: float) -> None:
        self.health.enter_graceful_shutdown()
        if self.watcher is not None:
            self.watcher.stop()
        self.server.stop(grace).wait()

    def start(self) -> None:
        tune_garbage_collector()
        self._start_server()
        self._set_health(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        if self.watcher is not None:
            self.watcher.start()
        else:
            self._set_health("", health_pb2.HealthCheckResponse.SERVING)
        logger.info("%s serving on %s%s", self.name, self.address, " (TLS)" if self.tls else "")

    def _dependencies_changed(self, healthy: bool, down: list[str]) -> None:
        with self.health_lock:
            if self.draining:
                return
            if healthy:
                self._set_health("", health_pb2.HealthCheckResponse.SERVING)
                logger.info("%s: every dependency is serving; SERVING", self.name)
            else:
                self._set_health("", health_pb2.HealthCheckResponse.NOT_SERVING)
                logger.warning("%s: %s not serving; NOT_SERVING until it is", self.name, ", ".join(down))

    def drain(self, drainable: Drainable, timeout: float, interrupted: threading.Event | None = None) -> bool:
        """NOT_SERVING, new requests refused, and up to timeout seconds (less if interrupted is set) for
        the requests in flight to finish, while the server goes on serving them. Whether they all did."""
        # New requests are refused before NOT_SERVING shows: a client that sees it and sends one anyway
        # must be refused, not admitted in the moment between the two.
        drainable.start_draining()
        with self.health_lock:
            self.draining = True
            self._set_health("", health_pb2.HealthCheckResponse.NOT_SERVING)
        logger.info("%s draining: NOT_SERVING, refusing new requests, up to %g s for those in flight",
                    self.name, timeout)
        deadline = time.monotonic() + timeout
        interrupted = interrupted or threading.Event()
        while not drainable.idle():
            if time.monotonic() >= deadline or interrupted.wait(DRAIN_POLL_S):
                logger.warning("%s: requests still in flight after the drain; stopping anyway", self.name)
                return False
        logger.info("%s drained", self.name)
        return True

    def stop(self, grace: float = 2.0) -> None:
        self._stop_server(grace)

    def serve_until_signalled(self, on_stop=None, main_loop=None, drainable: Drainable | None = None,
                              drain_timeout: float = 0.0) -> None:
        """Runs until SIGTERM or SIGINT, then (with drainable) drains for up to drain_timeout seconds, a
        second signal cutting the drain short, and shuts down cleanly. main_loop, if given, runs on this
        (the main) thread until the stop event is set."""
        stopping, interrupted = threading.Event(), threading.Event()
        stop_on_signals(stopping, interrupted)
        if os.environ.get(PARENT_PID_ENV):
            threading.Thread(target=self._stop_when_orphaned, args=(int(os.environ[PARENT_PID_ENV]), stopping),
                             name="parent-watch", daemon=True).start()
        self.start()
        if main_loop is not None:
            main_loop(stopping)
        stopping.wait()
        if drainable is not None:
            self.drain(drainable, drain_timeout, interrupted)
        logger.info("%s shutting down", self.name)
        if on_stop is not None:
            on_stop()
        self.stop()

    def _stop_when_orphaned(self, parent_pid: int, stopping: threading.Event) -> None:
        while not stopping.wait(PARENT_POLL_S):
            if os.getppid() != parent_pid:
                logger.warning("%s: its launcher (pid %d) is gone; shutting down", self.name, parent_pid)
                stopping.set()


class AioService(Service):
    """A Service whose server is gRPC's asyncio one, on an event loop of its own thread: its handlers are
    coroutines and async generators, every call served on that one thread. The rest (signals, the drain, the
    dependency watcher) runs on other threads as for a Service, and reaches the server and its health
    through the loop. max_workers is unused: calls are tasks, not threads."""

    def __init__(self, *args, **kwargs) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(target=self.loop.run_forever, name="grpc-aio", daemon=True)
        self.loop_thread.start()
        super().__init__(*args, **kwargs)

    def _on_loop(self, coroutine):
        """Runs a coroutine on the loop and waits for its result; from any thread but the loop's."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def _make_server(self, options, security: Security, public: bool, max_workers: int):
        async def make():  # the server and the health servicer's conditions belong to the loop they are made on
            return (grpc.aio.server(options=options, interceptors=[_AioGate(security, public)]),
                    health.aio.HealthServicer())

        return self._on_loop(make())

    def _start_server(self) -> None:
        self._on_loop(self.server.start())

    def _set_health(self, service: str, status) -> None:
        self._on_loop(self.health.set(service, status))

    def _stop_server(self, grace: float) -> None:
        if self.watcher is not None:
            self.watcher.stop()

        async def stop():
            # The asyncio servicer's graceful shutdown only freezes the statuses; the sync one's also turns
            # them NOT_SERVING, for the probes of the grace period.
            for service in ("", LIVENESS_SERVICE):
                await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
            await self.health.enter_graceful_shutdown()
            await self.server.stop(grace)

        self._on_loop(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.loop_thread.join()
        self.loop.close()


def stop_on_signals(stopping: threading.Event, interrupted: threading.Event | None = None) -> None:
    """SIGTERM or SIGINT sets `stopping`; the ones after it set `interrupted`. A handler runs on the main
    thread, which may be inside one of these events' own wait() at that moment, holding its lock: setting the
    event there would wait for that lock forever. So a thread of its own sets it."""
    received = []

    def on_signal(*_) -> None:
        received.append(True)
        event = stopping if len(received) == 1 or interrupted is None else interrupted
        threading.Thread(target=event.set, name="on-signal", daemon=True).start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)


# A step allocates thousands of short-lived objects; Python's default (a young collection every 700
# allocations, each tenth one older) would collect many times a step.
GC_YOUNG_THRESHOLD = 50_000


def tune_garbage_collector() -> None:
    """Once start-up is done. What it built (modules, weights, the tokenizer) lives as long as the process:
    frozen, the collector no longer walks it in every full collection; and young collections run less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def _each_thread(apply: Callable[[int], object]) -> None:
    """apply(thread id) for every thread of this process (Linux keeps CPU masks and nice values per thread)."""
    for thread_id in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            apply(int(thread_id))


def pin_to_cpus(cpus: str | None) -> None:
    """Every thread of this process, and each it starts later, on these CPUs (ServingConfig.cpus)."""
    if cpus is None:
        return
    wanted = parse_cpu_list(cpus)
    try:
        # The threads started so far each keep their own mask; new ones inherit their starter's.
        _each_thread(lambda thread_id: os.sched_setaffinity(thread_id, wanted))
    except OSError as error:  # none of them is available to this process
        raise SystemExit(f"cpus {cpus}: {error.strerror}: none of these CPUs is available to this process")
    # CPUs outside the process's cpuset are dropped without an error: a partial pin is refused too.
    got = os.sched_getaffinity(0)
    if got != wanted:
        raise SystemExit(f"cpus {cpus}: CPUs {format_cpu_list(wanted - got)} are not available to this process")
    logging.getLogger(__name__).info("running on CPUs %s", cpus)


def set_nice(nice: int | None) -> None:
    """Every thread of this process, and each it starts later, at this nice (ServingConfig.nice). Linux keeps a
    nice per thread: the ones started so far are set one by one; new ones inherit their starter's."""
    if nice is None or nice == os.getpriority(os.PRIO_PROCESS, 0):
        return
    try:
        _each_thread(lambda thread_id: os.setpriority(os.PRIO_PROCESS, thread_id, nice))
    except PermissionError:
        raise SystemExit(f"nice {nice}: below the nice this process started at "
                         f"({os.getpriority(os.PRIO_PROCESS, 0)}) needs CAP_SYS_NICE")
    logging.getLogger(__name__).info("running at nice %d", nice)


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
