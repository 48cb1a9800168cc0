"""Request checks the pydantic schemas cannot make, and the helpers that keep CPU work off the
event loop. Values that need the model (token ids against the vocabulary, top_k against it) are
checked by `SamplingParams.check_vocab`, which the engine runs for the offline API too."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pydantic import BaseModel

from flatserve.server.protocol import APIError

T = TypeVar("T")
# Tokenizing an 8 MiB prompt takes seconds on the dev box: on the event loop it stalled every
# other connection, /health included (7.4 s). Two threads: the box has 2 cores, and the engine
# thread needs one of them.
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="flatserve-tokenize")


async def off_loop(fn: Callable[[], T]) -> T:
    return await asyncio.get_running_loop().run_in_executor(_POOL, fn)


def _surrogate_path(v: Any, path: str) -> str | None:
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(v, dict):
        items = v.items()
    elif isinstance(v, (list, tuple)):
        items = enumerate(v)  # type: ignore[assignment]
    else:
        return None
    for k, x in items:
        if isinstance(k, str) and _surrogate_path(k, path) is not None:
            return f"{path}.{k!r}" if path else repr(k)
        found = _surrogate_path(x, f"{path}.{k}" if path else str(k))
        if found is not None:
            return found
    return None


def check_strings(req: BaseModel) -> None:
    """A lone surrogate (JSON's "\\ud800") in any text field is a 400 naming the field: no
    tokenizer, template or UTF-8 encoder takes one (it was a 500, and the 404 for an unknown
    `model` could not even encode its own message)."""
    path = _surrogate_path(req.model_dump(), "")
    if path is not None:
        raise APIError(400, f"'{path}' contains a lone surrogate (U+D800-U+DFFF): text must be "
                            f"valid Unicode", path)


def failed_request(why: str) -> Exception:
    """The engine failed this request alone (its sampling raised); the others went on."""
    return APIError(500, f"this request failed in the engine ({why}); other requests are not "
                         f"affected", None, "request_failed", "server_error")
