"""/v1/completions and /v1/chat/completions: validation, fan-out, streaming and collection."""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from flatserve.engine.chat import render
from flatserve.engine.outputs import CompletionOutput, RequestOutput
from flatserve.engine.outputs import RequestOutputKind
from flatserve.engine.sampling_params import SamplingParams, StructuredOutputs
from flatserve.server.async_engine import Unavailable
from flatserve.server.protocol import (APIError, ChatRequest, CompletionRequest, NamedToolChoice,
                                       _Sampling, dumps)
from flatserve.server.tools import (ToolStreamer, forced_spec, parse_auto, parse_forced,
                                    template_formats, template_messages)
from flatserve.server.validate import check_strings, failed_request, off_loop

MAX_PROMPTS = 256  # a batch of prompts is that many engine requests (times n)

if TYPE_CHECKING:
    from flatserve.server.state import ServerState


def _err(status: int, msg: str, param: str | None = None, code: str | None = None,
         type_: str = "invalid_request_error") -> Exception:
    return APIError(status, msg, param, code, type_)


def _check_model(state: ServerState, req: _Sampling) -> None:
    if req.model is not None and req.model != state.model_name:
        raise _err(404, f"The model '{req.model}' does not exist; this server serves "
                        f"'{state.model_name}'", "model", "model_not_found")


def _structured(req: _Sampling, tool_spec: StructuredOutputs | None = None
                ) -> StructuredOutputs | None:
    """The request's one output constraint: response_format, structured_outputs, or the
    grammar of a required/named tool_choice."""
    specs: list[tuple[str, StructuredOutputs]] = []
    rf, so = req.response_format, req.structured_outputs
    try:
        if rf is not None and rf.type == "json_object":
            specs.append(("response_format", StructuredOutputs(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise _err(400, "response_format of type json_schema needs 'json_schema'",
                           "response_format")
            specs.append(("response_format", StructuredOutputs(json=rf.json_schema.schema_)))
        if so is not None:
            specs.append(("structured_outputs", StructuredOutputs(
                json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                json_object=bool(so.json_object))))
    except ValueError as e:
        raise _err(400, str(e), "structured_outputs" if so is not None else "response_format") from None
    if tool_spec is not None:
        specs.append(("tool_choice", tool_spec))
    if len(specs) > 1:
        raise _err(400, f"only one output constraint per request; got {', '.join(n for n, _ in specs)}",
                   specs[1][0])
    return specs[0][1] if specs else None


async def _compile(state: ServerState, spec: StructuredOutputs | None, param: str) -> None:
    """Compile (cached) on the grammar thread: a bad schema, regex or grammar is a 400 here,
    and the engine admits the request at once."""
    if spec is None:
        return
    try:
        await asyncio.wrap_future(state.engine.grammars.submit(spec))
    except ValueError as e:
        raise _err(400, str(e), param) from None


def _params(req: _Sampling, max_tokens: int, logprobs: int | None,
            stop_ids: list[int] | None = None, structured: StructuredOutputs | None = None
            ) -> SamplingParams:
    try:
        return SamplingParams(
            n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
            min_p=req.min_p or 0.0, seed=req.seed, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
            logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()} or None,
            stop=req.stop, stop_token_ids=stop_ids, ignore_eos=req.ignore_eos, logprobs=logprobs,
            structured_outputs=structured,
            # A stream sends what is new each step; the engine then builds only that (the
            # cumulative text and token list of every streaming request grew every step).
            output_kind=RequestOutputKind.DELTA if getattr(req, "stream", False)
            else RequestOutputKind.CUMULATIVE)
    except ValueError as e:
        raise _err(400, str(e), getattr(e, "param", None)) from None


def _check_len(state: ServerState, ids: list[int], max_tokens: int | None, what: str) -> int:
    limit = state.engine.state.max_model_len
    if max_tokens is None:
        max_tokens = limit - len(ids)
    if len(ids) + max_tokens > limit:
        raise _err(400, f"This model's maximum context length is {limit} tokens. However, you "
                        f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the {what}, "
                        f"{max_tokens} for the completion). Reduce the length of the {what} or "
                        f"max_tokens.", "max_tokens", "context_length_exceeded")
    return max_tokens


def _tokenize(state: ServerState, prompt: str | list[int]) -> list[int]:
    try:
        return state.engine.tokenize(prompt)[1]
    except (ValueError, TypeError) as e:
        raise _err(400, str(e), "prompt") from None


def _prompts(req: CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise _err(400, "prompt is empty", "prompt")
    if all(isinstance(x, int) for x in p):
        return [p]  # type: ignore[list-item]
    if len(p) > MAX_PROMPTS:
        raise _err(400, f"at most {MAX_PROMPTS} prompts per request, got {len(p)}", "prompt")
    return list(p)  # type: ignore[arg-type]


async def _submit_all(state: ServerState, jobs: list[tuple[list[int], SamplingParams]]
                      ) -> list[tuple[str, asyncio.Queue]]:
    subs: list[tuple[str, asyncio.Queue]] = []
    try:
        for ids, params in jobs:
            subs.append(await state.async_engine.submit(ids, params))
    except (ValueError, Unavailable) as e:
        for rid, _ in subs:
            state.async_engine.abort(rid)
        if isinstance(e, Unavailable):
            raise _err(503, str(e), None, "service_unavailable", "server_error") from None
        raise _err(400, str(e), getattr(e, "param", None)) from None
    return subs


async def _next(q: asyncio.Queue) -> RequestOutput | None:
    item = await q.get()
    if isinstance(item, Unavailable):
        raise _err(503, str(item), None, "service_unavailable", "server_error")
    if isinstance(item, BaseException):
        raise _err(500, f"engine failed: {item}", None, "internal_error", "server_error")
    if item is not None and item.error is not None:
        raise failed_request(item.error)
    return item


async def _collect(state: ServerState, subs: list[tuple[str, asyncio.Queue]], raw: Request,
                   n: int) -> list[RequestOutput | None]:
    """Wait for every sub-request; a client that goes away aborts them all at once."""

    async def one(q: asyncio.Queue, n: int) -> RequestOutput | None:
        last = None
        while True:
            out = await _next(q)
            if out is None:  # aborted (shutdown): what it has so far, marked "abort"
                return _mark_aborted(last, n)
            if out.finished:
                return out
            last = out

    waiter = asyncio.gather(*(one(q, n) for _, q in subs))
    while not waiter.done():
        if await raw.is_disconnected():
            for rid, _ in subs:
                state.async_engine.abort(rid)
            waiter.cancel()
            return []
        await asyncio.wait({waiter}, timeout=0.1)
    try:
        return waiter.result()
    except BaseException:  # one prompt of several failed: the others stop too
        for rid, _ in subs:
            state.async_engine.abort(rid)
        raise


def _usage(prompt_lens: list[int], outs: list[RequestOutput | None]) -> dict[str, int]:
    comp = sum(len(c.token_ids) for o in outs if o for c in o.outputs)
    return {"prompt_tokens": sum(prompt_lens), "completion_tokens": comp,
            "total_tokens": sum(prompt_lens) + comp}


def _completion_logprobs(state: ServerState, c: CompletionOutput, start: int, offset: int) -> dict | None:
    if c.logprobs is None:
        return None
    dec = state.engine.tokenizer.decode
    toks, lps, tops, offs = [], [], [], []
    for tid, d in zip(c.token_ids[start:], c.logprobs[start:]):
        s = dec([tid])
        toks.append(s)
        lps.append(d[tid].logprob)
        tops.append({(lp.decoded_token or ""): lp.logprob for t, lp in d.items() if lp.rank is not None})
        offs.append(offset)
        offset += len(s)
    return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


def _chat_logprobs(c: CompletionOutput, start: int) -> dict | None:
    if c.logprobs is None:
        return None
    content = []
    for tid, d in zip(c.token_ids[start:], c.logprobs[start:]):
        tok = d[tid].decoded_token or ""
        content.append({"token": tok, "logprob": d[tid].logprob, "bytes": list(tok.encode()),
                        "top_logprobs": [{"token": lp.decoded_token or "", "logprob": lp.logprob,
                                          "bytes": list((lp.decoded_token or "").encode())}
                                         for t, lp in d.items() if lp.rank is not None]})
    return {"content": content}


async def completions(state: ServerState, req: CompletionRequest, raw: Request) -> Response:
    check_strings(req)
    _check_model(state, req)
    if req.echo and req.logprobs is not None:
        raise _err(400, "echo together with logprobs (prompt logprobs) is not supported", "echo")
    prompts = _prompts(req)
    ids = await off_loop(lambda: [_tokenize(state, p) for p in prompts])
    spec = _structured(req)
    jobs = [(i, _params(req, _check_len(state, i, req.max_tokens, "prompt"), req.logprobs, None, spec))
            for i in ids]
    await _compile(state, spec, "response_format" if req.response_format else "structured_outputs")
    echo = [(p if isinstance(p, str) else state.engine.tokenizer.decode(p)) if req.echo else ""
            for p in prompts]
    subs = await _submit_all(state, jobs)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def choice(k: int, c: CompletionOutput, text: str, start: int) -> dict:
        return {"index": k * req.n + c.index, "text": text, "finish_reason": c.finish_reason,
                "logprobs": _completion_logprobs(state, c, start, 0)}

    base = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name}
    if req.stream:
        return _stream(state, subs, raw, base, [len(i) for i in ids], req, choice, echo)
    outs = await _collect(state, subs, raw, req.n)
    choices = [choice(k, c, echo[k] + c.text, 0) for k, o in enumerate(outs) if o for c in o.outputs]
    return JSONResponse({**base, "choices": choices, "usage": _usage([len(i) for i in ids], outs)})


def _tool_setup(state: ServerState, req: ChatRequest
                ) -> tuple[str | None, list[str], set[str], StructuredOutputs | None]:
    """-> (mode: None | "auto" | "forced", the template's formats, tool names, forced grammar)."""
    tools = [t.model_dump() for t in req.tools or []]
    names = {t["function"]["name"] for t in tools}
    choice = req.tool_choice or ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise _err(400, "tool_choice needs a non-empty 'tools' list", "tool_choice")
    if not tools:
        return None, [], names, None
    formats = template_formats(state.template)
    if formats is None:
        raise _err(400, "this model's chat template does not support tools (it never reads "
                        "'tools'); pass --chat-template with one that does", "tools")
    if choice == "none":
        return None, formats, names, None
    if choice == "auto":
        return "auto", formats, names, None
    name = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if name is not None and name not in names:
        raise _err(400, f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
    return "forced", formats, names, forced_spec(tools, name, req.parallel_tool_calls)


def _messages(req: ChatRequest) -> list[dict[str, Any]]:
    msgs = []
    for m in req.messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        msgs.append(d)
    return template_messages(msgs)


def _message(c: CompletionOutput, mode: str | None, formats: list[str], names: set[str]
             ) -> tuple[dict[str, Any], str | None]:
    """A finished choice's message and finish reason; tool calls parsed out of the text."""
    calls = None
    content: str | None = c.text
    if mode == "forced" and c.finish_reason == "stop":
        calls = parse_forced(c.text)
        content = None
    elif mode == "auto":
        content, calls = parse_auto(c.text, formats, names)
    if not calls:
        return {"role": "assistant", "content": c.text}, c.finish_reason
    return ({"role": "assistant", "content": content,
             "tool_calls": [x.openai() for x in calls]}, "tool_calls")


async def chat(state: ServerState, req: ChatRequest, raw: Request) -> Response:
    check_strings(req)
    _check_model(state, req)
    if req.top_logprobs is not None and not req.logprobs:
        raise _err(400, "top_logprobs requires logprobs=true", "top_logprobs")
    mode, formats, names, tool_spec = _tool_setup(state, req)
    spec = _structured(req, tool_spec)
    tools = [t.model_dump() for t in req.tools] if req.tools and req.tool_choice != "none" else None
    try:
        msgs = _messages(req)
        ids = await off_loop(lambda: render(state.engine.tokenizer, state.template, msgs, tools=tools))
    except ValueError as e:
        raise _err(400, str(e), "messages") from None
    except Exception as e:  # jinja raises its own errors for templates that reject a conversation
        raise _err(400, f"the chat template rejected these messages: {e}", "messages") from None
    max_tokens = _check_len(state, ids, req.max_completion_tokens or req.max_tokens, "messages")
    stop_ids = [state.eot] if state.eot is not None else None
    params = _params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None, stop_ids, spec)
    await _compile(state, spec, "tool_choice" if tool_spec is not None else
                   "response_format" if req.response_format else "structured_outputs")
    subs = await _submit_all(state, [(ids, params)])
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    base = {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name}
    if req.stream:
        base["object"] = "chat.completion.chunk"
        streamers = {i: ToolStreamer(mode, formats, names) for i in range(req.n)} if mode else {}

        def delta(k: int, c: CompletionOutput, text: str, start: int) -> dict | list[dict] | None:
            lp = _chat_logprobs(c, start)
            if not mode:
                return {"index": c.index, "delta": {"content": text} if text else {},
                        "logprobs": lp, "finish_reason": c.finish_reason}
            deltas, reason = streamers[c.index].feed(text, c.finish_reason)
            if not deltas and reason is None:
                return None if lp is None or not lp["content"] else \
                    {"index": c.index, "delta": {}, "logprobs": lp, "finish_reason": None}
            deltas = deltas or [{}]
            return [{"index": c.index, "delta": d, "logprobs": lp if i == 0 else None,
                     "finish_reason": reason if i == len(deltas) - 1 else None}
                    for i, d in enumerate(deltas)]

        return _stream(state, subs, raw, base, [len(ids)], req, delta, [""], role_first=True)
    outs = await _collect(state, subs, raw, req.n)
    choices = []
    for o in outs:
        for c in o.outputs if o else ():
            msg, reason = _message(c, mode, formats, names)
            choices.append({"index": c.index, "message": msg, "logprobs": _chat_logprobs(c, 0),
                            "finish_reason": reason})
    return JSONResponse({**base, "choices": choices, "usage": _usage([len(ids)], outs)})


def _stream(state: ServerState, subs: list[tuple[str, asyncio.Queue]], raw: Request, base: dict,
            prompt_lens: list[int], req: _Sampling, make: Callable[..., dict], echo: list[str],
            role_first: bool = False) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        sent_tok: dict[tuple[int, int], int] = {}  # tokens streamed per (prompt, choice)
        live = set(range(len(subs)))
        try:
            if role_first:
                for i in range(req.n):
                    yield "data: " + dumps({**base, "choices": [{"index": i, "delta": {
                        "role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}]}) + "\n\n"
            for k, e in enumerate(echo):
                if e:
                    for i in range(req.n):
                        yield "data: " + dumps({**base, "choices": [{"index": k * req.n + i, "text": e,
                                                                     "logprobs": None, "finish_reason": None}]}) + "\n\n"
            getters = {asyncio.ensure_future(_next(subs[k][1])): k for k in live}
            while getters:
                done, _ = await asyncio.wait(getters, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    k = getters.pop(fut)
                    try:
                        out = fut.result()
                    except APIError as e:  # headers are out: the error goes as an event
                        for g in getters:
                            g.cancel()
                        yield "data: " + dumps(e.body()) + "\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    if out is None:  # aborted (shutdown): close its choices with a final chunk
                        for i in range(req.n):
                            made = _aborted(make, k, i)
                            for ch in [made] if isinstance(made, dict) else made or []:
                                yield "data: " + dumps({**base, "choices": [ch]}) + "\n\n"
                        continue
                    for c in out.outputs:  # DELTA outputs: text, tokens, logprobs are new
                        key = (k, c.index)
                        sent_tok[key] = sent_tok.get(key, 0) + len(c.token_ids)
                        if c.text or c.finish_reason or (c.token_ids and c.logprobs is not None):
                            made = make(k, c, c.text, 0)  # one choice, several, or none yet
                            for ch in [made] if isinstance(made, dict) else made or []:
                                yield "data: " + dumps({**base, "choices": [ch]}) + "\n\n"
                    if not out.finished:
                        getters[asyncio.ensure_future(_next(subs[k][1]))] = k
            if req.stream_options and req.stream_options.include_usage:
                comp = sum(sent_tok.values())
                usage = {"prompt_tokens": sum(prompt_lens), "completion_tokens": comp,
                         "total_tokens": sum(prompt_lens) + comp}
                yield "data: " + dumps({**base, "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or we finished): free whatever is still running
            for rid, _ in subs:
                state.async_engine.abort(rid)

    return StreamingResponse(events(), media_type="text/event-stream")


def _mark_aborted(last: RequestOutput | None, n: int) -> RequestOutput:
    """A non-streaming request ended by shutdown: never a 200 with finish_reason null."""
    if last is None:
        return RequestOutput("", None, [], [CompletionOutput(i, "", [], finish_reason="abort")
                                            for i in range(n)], True)
    for c in last.outputs:
        if c.finish_reason is None:
            c.finish_reason = "abort"
    last.finished = True
    return last


def _aborted(make: Callable[..., Any], k: int, i: int) -> Any:
    c = CompletionOutput(i, "", [], finish_reason="abort")
    return make(k, c, "", 0)
