"""The HTTP layer's defences, below the routes: auth, the body cap and body deadline (both
enforced while reading, chunked or not), the drain gate, and a header deadline for clients that
open a connection and trickle bytes (slowloris).

Plain ASGI, not `@app.middleware("http")`: Starlette's BaseHTTPMiddleware hides client
disconnects from `Request.is_disconnected()`, which the non-streaming abort relies on.
"""
from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_BODY_BYTES = 8 * 2**20
# A whole request body must arrive within this many seconds (8 MiB at 280 KB/s), and no read
# may wait longer than the idle limit: a half-sent body does not hold a connection open.
BODY_DEADLINE_S = 30.0
BODY_IDLE_S = 10.0
# Request line and headers must be complete this many seconds after the first byte (or after
# the connection opens): uvicorn's own keep-alive timer stops at the first byte.
HEADER_DEADLINE_S = 10.0

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


async def send_error(send: Send, status: int, message: str, code: str | None = None,
                     type_: str = "invalid_request_error") -> None:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}
                      ).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def header_map(scope: dict) -> dict[str, bytes]:
    """Lower-cased names -> raw values. Names and values are bytes on the wire and need not be
    UTF-8 (HTTP allows obs-text, 0x80-0xFF): decoding them as UTF-8 was a 500."""
    return {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}


def authorized(headers: dict[str, bytes], api_key: bytes) -> bool:
    auth = headers.get("authorization", b"")
    given = auth[7:] if auth[:7].lower() == b"bearer " else b""
    return hmac.compare_digest(given, api_key)  # bytes: any byte compares, none raises


async def read_body(receive: Receive, headers: dict[str, bytes], limit: int = MAX_BODY_BYTES
                    ) -> tuple[bytes | None, tuple[int, str, str] | None]:
    """-> (body, None), or (None, (status, message, code)) to refuse; (None, None) when the
    client went away. Counting as bytes arrive, so a chunked body past the cap is refused
    without reading the rest."""
    size = headers.get("content-length", b"").strip()
    if size.isdigit() and int(size) > limit:
        return None, (413, f"request body of {int(size)} bytes exceeds the limit of {limit} bytes",
                      "request_too_large")
    parts, total = [], 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BODY_DEADLINE_S
    while True:
        left = min(BODY_IDLE_S, deadline - loop.time())
        try:
            msg = await asyncio.wait_for(receive(), timeout=max(left, 0.0))
        except asyncio.TimeoutError:
            return None, (408, f"the request body did not arrive in time (the limits: "
                               f"{BODY_IDLE_S:g} s between reads, {BODY_DEADLINE_S:g} s in all)",
                          "request_timeout")
        if msg["type"] == "http.disconnect":
            return None, None
        chunk = msg.get("body", b"")
        total += len(chunk)
        if total > limit:
            return None, (413, f"request body exceeds the limit of {limit} bytes",
                          "request_too_large")
        parts.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(parts), None


async def discard_body(receive: Receive, limit: int = 8 * MAX_BODY_BYTES) -> None:
    """After a 413, read (and drop) what the client is still sending, up to `limit` bytes: a
    server that closes with unread bytes makes the kernel reset the connection, and the client
    may lose the 413 it has not read yet (it sees a broken pipe instead)."""
    total = 0
    while total <= limit:
        try:
            msg = await asyncio.wait_for(receive(), timeout=BODY_IDLE_S)
        except asyncio.TimeoutError:
            return
        if msg["type"] != "http.request":
            return
        total += len(msg.get("body", b""))
        if not msg.get("more_body", False):
            return


def replay(body: bytes, receive: Receive) -> Receive:
    """The app's `receive`: the body read above, then the real channel (disconnects)."""
    sent = False

    async def inner() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return inner


class GuardMiddleware:
    def __init__(self, app: Any, state: Any) -> None:
        self.app, self.state = app, state
        self.api_key = None if state.api_key is None else state.api_key.encode()

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = header_map(scope)
        if scope["path"] != "/health" and self.api_key is not None \
                and not authorized(headers, self.api_key):
            return await send_error(send, 401, "invalid or missing API key (send Authorization: "
                                    "Bearer KEY)", "invalid_api_key", "authentication_error")
        if scope["method"] == "POST":
            busy = self.state.refusal()
            if busy is not None:
                return await send_error(send, 503, busy, "service_unavailable", "server_error")
            body, refuse = await read_body(receive, headers)
            if refuse is not None:
                await send_error(send, *refuse)
                if refuse[0] == 413:
                    await discard_body(receive)
                return
            if body is None:
                return  # the client went away mid-body
            receive = replay(body, receive)
        await self.app(scope, receive, send)


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a header deadline: a connection whose request line and
    headers are not complete within HEADER_DEADLINE_S of its first byte (or of opening) is
    closed. Bodies are timed by `read_body`, idle keep-alive connections by uvicorn."""

    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(HEADER_DEADLINE_S, self._expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self._arm()  # a new request starts: its headers are on the clock
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
