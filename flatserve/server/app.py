"""FastAPI app: auth, OpenAI-shaped errors, routes, and the uvicorn runner with graceful exit."""
from __future__ import annotations

import argparse
import hmac
import json
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import flatserve
from flatserve.config import EngineConfig
from flatserve.engine.chat import chat_template
from flatserve.engine.engine import Engine
from flatserve.server.async_engine import AsyncEngine
from flatserve.server.metrics import Metrics
from flatserve.server.protocol import ChatRequest, CompletionRequest

log = logging.getLogger("flatserve")
MAX_BODY_BYTES = 8 * 2**20


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   type_: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if err.get("type") == "extra_forbidden":
        return f"unsupported parameter '{param}': flatserve does not implement it", param
    if err.get("type") == "json_invalid":
        return f"malformed JSON body: {err.get('msg')}", None
    if err.get("type") == "missing":
        return f"missing required parameter '{param}'", param
    return f"invalid value for '{param}': {err.get('msg')}", param


class ServerState:
    def __init__(self, cfg: EngineConfig, api_key: str | None) -> None:
        self.metrics = Metrics()
        self.async_engine = AsyncEngine(lambda: Engine(cfg), self.metrics)  # built on its thread
        self.engine = engine = self.async_engine.engine
        self.model_name = cfg.served_model_name or _default_name(cfg)
        self.api_key = api_key
        self.created = int(time.time())
        self.template, self.eot = chat_template(engine.tokenizer, engine.state.model.architecture,
                                                cfg.chat_template)
        b = engine.state.budget
        self.metrics.set_budget({"total": b.total, "reserve": b.reserve, "runtime": b.runtime,
                                 "weights": b.weights, "peak_activations": b.peak,
                                 "kv_budget": b.kv_budget, "kv_token_capacity": b.token_capacity})
        self.metrics.set_weights(engine.state.weight_formats)
        self.metrics.update(engine.stats())


def _default_name(cfg: EngineConfig) -> str:
    from pathlib import Path

    return Path(cfg.model).name if cfg.model else "gemma-3-270m-q4_k_m"


class GuardMiddleware:
    """Auth (constant-time key compare) and the body-size limit, as plain ASGI.

    Not `@app.middleware("http")`: Starlette's BaseHTTPMiddleware hides client disconnects
    from `Request.is_disconnected()`, which the non-streaming abort relies on.
    """

    def __init__(self, app: Any, api_key: str | None) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        resp: Response | None = None
        if scope["path"] != "/health" and self.api_key is not None:
            auth = headers.get("authorization", "")
            given = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(given.encode(), self.api_key.encode()):
                resp = error_response(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                                      code="invalid_api_key", type_="authentication_error")
        size = headers.get("content-length", "")
        if resp is None and size.isdigit() and int(size) > MAX_BODY_BYTES:
            resp = error_response(413, f"request body of {size} bytes exceeds the limit of "
                                       f"{MAX_BODY_BYTES} bytes", code="request_too_large")
        if resp is not None:
            return await resp(scope, receive, send)
        await self.app(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    from flatserve.server import routes

    app = FastAPI(title="flatserve", version=flatserve.__version__)
    app.state.s = state

    app.add_middleware(GuardMiddleware, api_key=state.api_key)

    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = _validation_message(exc)
        return error_response(400, msg, param)

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.type)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), type_="not_found_error"
                              if exc.status_code == 404 else "invalid_request_error")

    @app.get("/health")
    async def health() -> Response:
        if state.async_engine.error is not None:
            return PlainTextResponse("engine failed", status_code=503)
        return PlainTextResponse("ok")

    @app.get("/version")
    async def version() -> dict:
        return {"version": flatserve.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "flatserve", "max_model_len": state.engine.state.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await routes.completions(state, req, raw)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, raw: Request) -> Response:
        return await routes.chat(state, req, raw)

    return app


_GEMM_NAMES = {"amx": ", AMX linears", "onednn": ", oneDNN linears"}  # start-up line


def _weights_text(s: Any) -> str:
    """'q4_k x 27 (9.7 MiB), ..., dense x 0 (...); 241.0 MiB': each linear format, then all
    weights' bytes (norms and anything unquantized included)."""
    from flatserve.model.quant import describe

    return f"{describe({k: (n, b) for k, n, b in s.weight_formats})}; {s.weights_bytes / 2**20:.1f} MiB"


def run_server(cfg: EngineConfig, args: argparse.Namespace) -> int:
    import signal

    import uvicorn

    state = ServerState(cfg, args.api_key)
    app = build_app(state)
    state.async_engine.start()
    s = state.engine.state
    print(f"flatserve {flatserve.__version__}: model {state.model_name} ({s.model.architecture}), "
          f"dtype {str(s.dtype).replace('torch.', '')}"
          f", weights {_weights_text(s)}, device {s.device}, "
          f"backend {s.backend}{', fused ' + ','.join(sorted(s.fused_ops)) if s.fused_ops else ''}"
          f"{_GEMM_NAMES.get(s.cpu_gemm, '')}"
          f"{', async scheduling' if state.engine.async_mode else ''}, "
          f"KV {s.budget.num_blocks - 1} blocks = {s.budget.token_capacity} tokens, "
          f"max_model_len {s.max_model_len}, http://{args.host}:{args.port}", flush=True)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # Stop accepting first, then end every in-flight request with a final chunk so that
            # open streams close and uvicorn's graceful wait ends promptly.
            state.async_engine.abort_all()
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                   timeout_graceful_shutdown=5))
    signal.signal(signal.SIGTERM, lambda *a: server.handle_exit(signal.SIGTERM, None))
    server.run()
    state.async_engine.shutdown()
    return 0


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
