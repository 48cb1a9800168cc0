"""Offline API shaped like vLLM's: `LLM(model=...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from flatserve.config import EngineConfig
from flatserve.engine.chat import chat_template, render
from flatserve.engine.engine import Engine
from flatserve.engine.outputs import RequestOutput
from flatserve.engine.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]


class LLM:
    """Owns an Engine and steps it until every request is done (no inherited loop)."""

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None,
                 **kwargs: Any) -> None:
        self.config = config or EngineConfig.from_kwargs(model=model, **kwargs)
        self.engine = Engine(self.config)
        self._template, self._eot = chat_template(
            self.engine.tokenizer, self.engine.state.model.architecture, self.config.chat_template)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker ranks now (they also stop when this process exits)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        return cls(config=config)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing changed) while requests are unfinished."""
        return self.engine.kv.reset_prefix_cache()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params = sampling_params if sampling_params is not None else SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} sampling params for {len(prompts)} prompts")
        # Validate everything before queuing anything: a bad prompt fails the call, not half of it.
        ids = [self._prompt_ids(p) for p in prompts]
        for p in plist:
            p.validate()
            p.check_vocab(self.engine.state.model.vocab_size)
            if p.structured_outputs is not None:  # compile now: a bad schema fails the call
                self.engine.grammars.submit(p.structured_outputs).result()
        rids = [self.engine.add_request(i, p) for i, p in zip(ids, plist)]
        return self._run(rids, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True
             ) -> list[RequestOutput]:
        convs = messages if messages and isinstance(messages[0], list) else [messages]
        params = copy.copy(sampling_params or SamplingParams())
        if self._eot is not None:
            params.stop_token_ids = list({*(params.stop_token_ids or []), self._eot})
        ids = [render(self.engine.tokenizer, self._template, c) for c in convs]  # type: ignore[arg-type]
        return self.generate(ids, params, use_tqdm)

    def _prompt_ids(self, p: Prompt) -> str | list[int]:
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                return list(p["prompt_token_ids"])
            return p["prompt"]
        return p

    def _run(self, rids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(rids), desc="generate", disable=not use_tqdm, unit="req")
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step(emit_unfinished=False):
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in rids:  # leave no request (and no KV block) behind
                self.engine.abort(rid)
            raise
        finally:
            bar.close()
        return [done[r] for r in rids]
