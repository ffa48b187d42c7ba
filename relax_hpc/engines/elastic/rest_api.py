"""The elastic REST API of a running job: list, add and remove rollout engines over HTTP.

The driver serves it so that users and grow jobs (extra rollout engines submitted as separate
Slurm jobs) can change the rollout fleet at run time. Each route is one call of
`ElasticControl.elastic(action, body)` (elastic/api.py has the actions, their bodies and their
replies), whose status and body go back to the client as they are:

    GET  /health                       200 {"status": "ok"}
    GET  /rollout/engines              "engines"
    POST /rollout/scale_out            "scale_out"   body: a JSON object, e.g. {"num_engines": 2}
    POST /rollout/scale_in             "scale_in"    body: a JSON object, e.g. {"num_engines": 1}
    GET  /rollout/operations           "operations"
    GET  /rollout/operations/{op_id}   "operation"   with {"id": op_id}

Every request, any path or method, needs `Authorization: Bearer <token>` (the job's
`JobSecret.token("rest")`, `rest_token()`); without it the answer is 401, given before the body
is read. Every error is `{"error": "<what is wrong and what to do>"}`: a body that is not a JSON
object 400, over `max_body_bytes` 413, an unknown path 404, a wrong method 405, a control that
raised (the rollout actor died) 503. FastAPI's /docs, /redoc and /openapi.json are switched off:
the routes are the table above and docs/federation.md.

    app = make_rest_app(control, token=rest_token())
    with RestServer(app, host="0.0.0.0", port=0) as server:   # in the driver
        print(server.url)
    status, body = RestClient(url, token).get("/rollout/engines")   # in a grow job, or the CLI

Tests: tests/engines/test_rest_api.py (a real uvicorn server on 127.0.0.1 and real clients).
"""

from __future__ import annotations

import json
import logging
import socket
from types import TracebackType
from typing import Any, Self

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocketClose

from relax_hpc.auth import bearer_matches, job_secret
from relax_hpc.engines.elastic.api import REST_TOKEN_PURPOSE, ElasticControl, ElasticReply
from relax_hpc.engines.http.auth import check_token
from relax_hpc.engines.http.body import RequestRefused, read_limited_body
from relax_hpc.ops.http import TRANSPORT_ERRORS, http_client
from relax_hpc.engines.http.serving import ServingError, ServingLimits, UvicornThread, bearer_trust, uvicorn_config

__all__ = [
    "MAX_BODY_BYTES",
    "REST_AUTH_MESSAGE",
    "REST_LIMITS",
    "REST_ROUTES",
    "REST_TOKEN_PURPOSE",
    "RestClient",
    "RestServer",
    "RestServerError",
    "RestUnavailable",
    "make_rest_app",
    "rest_token",
]

log = logging.getLogger(__name__)

# Elastic bodies are a few keys and at most a list of engine URLs; 1 MiB is thousands of URLs.
MAX_BODY_BYTES = 1024 * 1024
REST_AUTH_MESSAGE = (
    "missing or wrong bearer token: send 'Authorization: Bearer <token>' with the job's REST token, "
    f"JobSecret.token('{REST_TOKEN_PURPOSE}') of the job secret in JOBDIR/.secret; the job directory's "
    "cluster.json names this server (docs/federation.md)"
)
REST_ROUTES = (
    "GET /health",
    "GET /rollout/engines",
    "POST /rollout/scale_out",
    "POST /rollout/scale_in",
    "GET /rollout/operations",
    "GET /rollout/operations/{op_id}",
)
_ROUTE_LIST = ", ".join(REST_ROUTES)
_BODY_EXAMPLES = {"scale_out": '{"num_engines": 2}', "scale_in": '{"num_engines": 1}'}
_MAX_ERROR_CHARS = 300  # of a control's exception message; Ray's can carry a remote traceback


def rest_token() -> str:
    """This job's REST token (RELAX_HPC_SECRET_FILE names the secret)."""
    return job_secret().token(REST_TOKEN_PURPOSE)


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


class _RequireToken:
    """ASGI middleware: 401 to every HTTP request whose bearer token is not `token`, answered
    from the headers alone, before routing, so no body is read (and no "100 Continue" sent)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app, self.token = app, token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":  # no route speaks it
            await WebSocketClose(code=1008)(scope, receive, send)
            return
        if scope["type"] == "http" and not bearer_matches(Headers(scope=scope).get("authorization"), self.token):
            await _error(401, REST_AUTH_MESSAGE, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _json_object(raw: bytes, action: str) -> dict[str, Any]:
    """The body as a dict; 400 naming what was sent and showing an example when it is not one."""
    example = f"send a JSON object, e.g. {_BODY_EXAMPLES[action]} (docs/federation.md lists the keys)"
    try:
        value = json.loads(raw)  # bytes: UTF-8, -16 or -32, as RFC 8259 allows
    except RecursionError:
        raise RequestRefused(400, f"the body nests too deep to decode; {example}") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError both are
        what = "empty" if not raw.strip() else f"not valid JSON ({e})"
        raise RequestRefused(400, f"the body is {what}; {example}") from None
    if not isinstance(value, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")
        raise RequestRefused(400, f"the body is {kind}, not a JSON object; {example}")
    return value


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    line = text[0] if text else ""
    return line if len(line) <= _MAX_ERROR_CHARS else line[: _MAX_ERROR_CHARS - 3] + "..."


def _reply_response(action: str, reply: Any) -> JSONResponse:
    """The control's reply as an HTTP response; 500 when it is not a JSON-able ElasticReply."""
    usable = (isinstance(reply, ElasticReply) and isinstance(reply.status, int) and 100 <= reply.status <= 599
              and isinstance(reply.body, dict))
    if usable:
        try:
            return JSONResponse(reply.body, status_code=reply.status)
        except (TypeError, ValueError) as e:  # a body json.dumps refuses (an object, NaN)
            log.error("the rollout role's reply to %r is not JSON: %s", action, e)
    else:
        log.error("the rollout role answered %r with %r, not an ElasticReply", action, reply)
    return _error(500, f"the rollout role's reply to {action!r} is not an HTTP status and a JSON object; this is "
                       "a bug in relax-hpc: the driver log has the reply")


async def _call(control: ElasticControl, action: str, body: dict[str, Any]) -> JSONResponse:
    """One control call, in a worker thread (it blocks on Ray). An exception becomes 503 with
    its type and first line; the traceback goes to the driver log only."""
    try:
        reply = await run_in_threadpool(control.elastic, action, body)
    except Exception as e:  # a dead or unreachable rollout role: the client learns it, the log keeps the trace
        log.exception("elastic action %r failed in the rollout role", action)
        return _error(503, f"the rollout role did not answer: {type(e).__name__}: {_first_line(e)}; "
                           "the driver log (JOBDIR/logs/) has the traceback; retry once the job is running again")
    return _reply_response(action, reply)


def _install_error_handlers(app: FastAPI) -> None:
    """Every error in the {"error": message} shape: 404 and 405 list the routes, FastAPI's
    validation errors become 400 (not 422), anything unexpected 500 without a traceback."""

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message = f"no route {where}; routes: {_ROUTE_LIST}"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"method {request.method} is not allowed on {request.url.path} (it takes {allowed}); routes: {_ROUTE_LIST}"
        else:
            message = str(exc.detail)
        return _error(exc.status_code, message, dict(exc.headers or {}))

    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg', '')}" for e in exc.errors())
        return _error(400, f"bad request to {request.method} {request.url.path}: {problems}; routes: {_ROUTE_LIST}")

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("REST %s %s failed", request.method, request.url.path, exc_info=exc)
        return _error(500, f"the REST server failed on {request.method} {request.url.path} ({type(exc).__name__}); "
                           "the driver log has the traceback")

    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, unexpected)


def make_rest_app(control: ElasticControl, token: str, *, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The REST app over `control`; every request must carry `Authorization: Bearer <token>`."""
    check_token(token, "the REST server")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    app = FastAPI(title="relax-hpc elastic REST API", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_RequireToken, token=token)
    app.state.bearer_trust = bearer_trust(token)  # RestServer's connection limits tell trusted clients by it
    _install_error_handlers(app)

    async def post(request: Request, action: str) -> JSONResponse:
        try:
            body = _json_object(await read_limited_body(request, max_body_bytes, "this API"), action)
        except RequestRefused as e:
            return _error(e.status, e.message)
        return await _call(control, action, body)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/rollout/engines")
    async def engines() -> JSONResponse:
        return await _call(control, "engines", {})

    @app.post("/rollout/scale_out")
    async def scale_out(request: Request) -> JSONResponse:
        return await post(request, "scale_out")

    @app.post("/rollout/scale_in")
    async def scale_in(request: Request) -> JSONResponse:
        return await post(request, "scale_in")

    @app.get("/rollout/operations")
    async def operations() -> JSONResponse:
        return await _call(control, "operations", {})

    @app.get("/rollout/operations/{op_id}")
    async def operation(op_id: str) -> JSONResponse:
        return await _call(control, "operation", {"id": op_id})

    return app


class RestServerError(ServingError):
    """The REST server could not start listening; the message says where and why."""


# The REST API's limits: its clients are a few grow jobs and CLI calls with bodies of a few keys,
# so a request has 10 s to arrive and one address 16 connections before it shows the token.
REST_LIMITS = ServingLimits(request_timeout_s=10.0, max_connections=64, max_untrusted_per_peer=16)


class RestServer:
    """Runs an ASGI app with uvicorn in a daemon thread: `start()` returns once it listens,
    `url` has the real port, `stop()` closes the port and joins the thread. A context manager.

    It binds the socket itself before uvicorn starts, so a port in use fails `start()` with a
    RestServerError saying so (uvicorn would log it and exit the thread). Connections are under
    `limits` (http/serving.py): a request deadline, a total cap and a cap per peer address on
    connections that have not shown the app's token (`make_rest_app` records it on the app)."""

    def __init__(self, app: ASGIApp, host: str, port: int = 0, *, start_timeout_s: float = 30.0,
                 shutdown_timeout_s: float = 5.0, limits: ServingLimits = REST_LIMITS) -> None:
        self.app, self.host, self.start_timeout_s = app, host, start_timeout_s
        self.port = port  # the real port once started
        self.limits = limits
        trusts = getattr(getattr(app, "state", None), "bearer_trust", None)
        self._config = uvicorn_config(app, limits, trusts=trusts, shutdown_timeout_s=shutdown_timeout_s,
                                      busy_body={"error": f"the REST server has {limits.max_connections} "
                                                          "connections open, its limit; retry in a second"})
        self._shutdown_timeout_s = shutdown_timeout_s
        self._runner: UvicornThread | None = None

    @property
    def url(self) -> str:
        """http://host:port; a wildcard host (0.0.0.0, ::) becomes this machine's name."""
        if self._runner is None:
            raise RuntimeError("RestServer.url is known once start() has returned")
        host = socket.gethostname() if self.host in ("", "0.0.0.0", "::") else self.host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def start(self) -> Self:
        if self._runner is not None:
            raise RuntimeError("RestServer.start() was already called; make a new RestServer to serve again")
        try:
            runner = UvicornThread(self._config, self.host, self.port, "the REST server",
                                   start_timeout_s=self.start_timeout_s, shutdown_timeout_s=self._shutdown_timeout_s)
            self.port = runner.port
            runner.start()
        except ServingError as e:
            raise RestServerError(str(e)) from None
        self._runner = runner
        return self

    def stop(self) -> None:
        """Stop listening, finish or cut open requests, join the thread. Safe to call twice."""
        if self._runner is not None:
            self._runner.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class RestUnavailable(ConnectionError):
    """The REST server did not answer (refused, reset or timed out); the message names its URL."""


class RestClient:
    """Calls a job's REST API: `get(path)` and `post(path, body)` return (status, JSON body);
    4xx and 5xx replies come back the same way, only a server that does not answer raises
    RestUnavailable. The token goes to `url` only: no redirects, no HTTP(S)_PROXY.

        with RestClient(url, token) as client:
            status, body = client.post("/rollout/scale_out", {"num_engines": 2})
    """

    def __init__(self, url: str, token: str, timeout_s: float = 30.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"a REST URL starts with http:// or https://, got {url!r} "
                             "(the job directory's cluster.json has the job's)")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._client = http_client(timeout_s, token)

    def get(self, path: str) -> tuple[int, dict[str, Any]]:
        return self._request("GET", path, None)

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return self._request("POST", path, body)

    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> tuple[int, dict[str, Any]]:
        if not path.startswith("/"):
            raise ValueError(f"a REST path starts with '/', e.g. '/rollout/engines'; got {path!r}")
        target = self.url + path
        try:
            reply = self._client.request(method, target, json=body)
        except TRANSPORT_ERRORS as e:  # refused, reset, timed out, not HTTP
            raise RestUnavailable(
                f"the REST server at {self.url} did not answer {method} {path} ({type(e).__name__}: {e or 'no detail'}"
                f"; timeout {self.timeout_s} s): is the job still running? Its URL is in the job directory's "
                "cluster.json, and the driver log (JOBDIR/logs/) says why it stopped") from None
        try:
            value = reply.json()
        except ValueError:
            value = None
        if not isinstance(value, dict):
            value = {"error": f"{method} {target} answered {reply.status_code} with a body that is not a JSON "
                              f"object: {reply.text[:200]!r}"}
        return reply.status_code, value

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
