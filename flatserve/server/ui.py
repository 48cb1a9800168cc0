"""The chat page at `/`: three files shipped in the package, served ahead of the API-key guard.

The page itself holds no secret (it asks for the key and sends it on every API call), so it and
its files are served without the key; everything it talks to (/v1/*, /metrics) still needs it.
"""
from __future__ import annotations

from importlib import resources
from typing import Any

# URL path -> (file in flatserve/server/static, content type)
_FILES = {"/": ("index.html", "text/html; charset=utf-8"),
          "/ui/chat.css": ("chat.css", "text/css; charset=utf-8"),
          "/ui/chat.js": ("chat.js", "text/javascript; charset=utf-8")}

# Defence in depth behind the renderer's textContent-only DOM building: no inline script, no
# script or style from anywhere else, no request to another origin (the page works offline).
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def _headers(ctype: str, length: int) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", ctype.encode()), (b"content-length", str(length).encode()),
            (b"cache-control", b"no-cache"), (b"x-content-type-options", b"nosniff"),
            (b"content-security-policy", CSP.encode())]


class ChatPage:
    """ASGI middleware: GET/HEAD of the page's paths answer from memory; all else passes on."""

    def __init__(self, app: Any) -> None:
        self.app = app
        root = resources.files("flatserve.server") / "static"
        self.files = {path: (root.joinpath(name).read_bytes(), ctype)
                      for path, (name, ctype) in _FILES.items()}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] not in self.files:
            return await self.app(scope, receive, send)
        if scope["method"] not in ("GET", "HEAD"):
            body, ctype, status = b'{"error":{"message":"method not allowed","type":' \
                b'"invalid_request_error","param":null,"code":null}}', "application/json", 405
        else:
            (body, ctype), status = self.files[scope["path"]], 200
        await send({"type": "http.response.start", "status": status,
                    "headers": _headers(ctype, len(body))})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})
