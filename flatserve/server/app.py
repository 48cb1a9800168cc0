"""FastAPI app: auth, OpenAI-shaped errors, routes, and the uvicorn runner with graceful exit."""
from __future__ import annotations

import argparse
import logging
import sys
import os
import signal
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import flatserve
from flatserve.config import EngineConfig
from flatserve.server import routes
from flatserve.server.guard import MAX_BODY_BYTES, GuardedH11, GuardMiddleware  # noqa: F401
from flatserve.server.protocol import APIError, ChatRequest, CompletionRequest
from flatserve.server.state import ServerState

log = logging.getLogger("flatserve")


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


def build_app(state: ServerState, ui: bool = True) -> FastAPI:
    app = FastAPI(title="flatserve", version=flatserve.__version__)
    app.state.s = state

    app.add_middleware(GuardMiddleware, state=state)

    @app.exception_handler(RecursionError)
    async def on_deep(_: Request, exc: RecursionError) -> JSONResponse:
        return error_response(400, "malformed JSON body: nested too deeply")

    @app.exception_handler(Exception)
    async def on_bug(_: Request, exc: Exception) -> JSONResponse:  # a bug: still OpenAI's shape
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}", code="internal_error",
                              type_="server_error")

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
        if state.draining:
            return PlainTextResponse("shutting down", status_code=503)
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

    if ui:  # added last, so outermost: the page loads without the API key (it then asks for it)
        from flatserve.server.ui import ChatPage

        app.add_middleware(ChatPage)
    return app


_GEMM_NAMES = {"amx": ", AMX linears", "onednn": ", oneDNN linears", "avx2": ", AVX2 bf16 linears"}  # start-up line


def _weights_text(s: Any) -> str:
    """'q4_k x 27 (9.7 MiB), ..., dense x 0 (...); 241.0 MiB': each linear format, then all
    weights' bytes (norms and anything unquantized included)."""
    from flatserve.model.quant import describe

    return f"{describe({k: (n, b) for k, n, b in s.weight_formats})}; {s.weights_bytes / 2**20:.1f} MiB"


def run_server(cfg: EngineConfig, args: argparse.Namespace) -> int:
    state = ServerState(cfg, args.api_key)
    app = build_app(state, ui=not getattr(args, "no_ui", False))
    state.async_engine.start()
    s = state.engine.state
    print(f"flatserve {flatserve.__version__}: model {state.model_name} ({s.model.architecture}), "
          f"dtype {str(s.dtype).replace('torch.', '')}"
          f", weights {_weights_text(s)}, device {s.device}, "
          f"backend {s.backend}{', fused ' + ','.join(sorted(s.fused_ops)) if s.fused_ops else ''}"
          f"{_GEMM_NAMES.get(s.cpu_gemm, '')}"
          f"{', async scheduling' if state.engine.async_mode else ''}"
          f"{_parallel_note(cfg)}, "
          f"KV {s.budget.num_blocks - 1} blocks = {s.budget.token_capacity} tokens, "
          f"max_model_len {s.max_model_len}, http://{args.host}:{args.port}", flush=True)
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           http=GuardedH11, timeout_graceful_shutdown=5),
                            state, getattr(args, "shutdown_timeout", 30.0))
    state.async_engine.on_fatal = server.engine_stopped
    engines = getattr(state.async_engine, "engines", lambda: [state.engine])()
    for e in engines:  # a tensor-parallel rank that dies stops the server (exit 1)
        if e.executor is not None:
            e.executor.workers.on_fatal = lambda msg: server.engine_stopped(RuntimeError(msg))
    server.run()
    state.async_engine.shutdown()
    failed = [e.executor.workers.failed for e in engines if e.executor and e.executor.workers.failed]
    if failed:
        print(f"flatserve: error: {failed[0]}", file=sys.stderr, flush=True)
        return 1
    return server.exit_code


class DrainingServer(uvicorn.Server):
    """uvicorn's server with an exit that drains: on SIGTERM or SIGINT new generation requests
    (and /health) get 503, in-flight requests run on for up to `shutdown_timeout` seconds, the
    rest then end with finish_reason "abort", and the process exits 0. A second SIGINT exits at
    once. An engine that stops on an error makes it exit 1, so that a supervisor restarts it."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state, self.shutdown_timeout = state, shutdown_timeout
        self.exit_code = 0
        self._drain: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._drain is not None:
            if sig == signal.SIGINT:
                os._exit(130)  # the second Ctrl-C: now, no drain
            return
        # Not uvicorn's handle_exit: it stops the listener at once, and re-raises the signal
        # after the run (SIGTERM's default action would make the exit code -15).
        log.info("shutting down: draining %d request(s) for up to %gs",
                 self.state.async_engine.num_in_flight, self.shutdown_timeout)
        self.state.draining = True
        self._drain = threading.Thread(target=self._drain_then_exit, name="flatserve-drain",
                                       daemon=True)
        self._drain.start()

    def _drain_then_exit(self) -> None:
        eng = self.state.async_engine
        deadline = time.monotonic() + self.shutdown_timeout
        while eng.num_in_flight and time.monotonic() < deadline and eng.error is None:
            time.sleep(0.05)
        eng.close()  # what still runs ends with finish_reason "abort"; later submits get 503
        deadline = time.monotonic() + 5  # the aborted requests' final chunks go out
        while eng.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        self.should_exit = True

    def engine_stopped(self, e: BaseException) -> None:
        self.exit_code = 1
        self.should_exit = True


def _parallel_note(cfg: EngineConfig) -> str:
    parts = [f"tensor parallel {cfg.tensor_parallel_size}" if cfg.tensor_parallel_size > 1 else "",
             f"data parallel {cfg.data_parallel_size}" if cfg.data_parallel_size > 1 else "",
             f"{cfg.nnodes} nodes" if cfg.nnodes > 1 else ""]
    return "".join(", " + p for p in parts if p)
