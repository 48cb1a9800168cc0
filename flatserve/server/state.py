"""What every route of the server reads: the engine behind its async front, the metrics, the
served model's name and chat template, the API key, and whether the server is draining.
`app.py` builds it and hands it to `routes.py`; neither module is imported back from here."""
from __future__ import annotations

import time
from pathlib import Path

from flatserve.config import EngineConfig
from flatserve.engine.chat import chat_template
from flatserve.engine.engine import Engine
from flatserve.server.async_engine import AsyncEngine
from flatserve.server.metrics import Metrics


class ServerState:
    def __init__(self, cfg: EngineConfig, api_key: str | None) -> None:
        self.metrics = Metrics()
        if cfg.data_parallel_size > 1:
            from flatserve.server.data_parallel import DataParallelEngine

            self.async_engine = DataParallelEngine(cfg, self.metrics)  # type: ignore[assignment]
        else:
            self.async_engine = AsyncEngine(lambda: Engine(cfg), self.metrics)  # built on its thread
        self.engine = engine = self.async_engine.engine
        self.model_name = cfg.served_model_name or _default_name(cfg)
        self.api_key = api_key
        self.created = int(time.time())
        self.draining = False  # SIGTERM/SIGINT received: new generation requests get 503
        self.template, self.eot = chat_template(engine.tokenizer, engine.state.model.architecture,
                                                cfg.chat_template)
        b = engine.state.budget
        self.metrics.set_budget({"total": b.total, "reserve": b.reserve, "runtime": b.runtime,
                                 "weights": b.weights, "peak_activations": b.peak,
                                 "kv_budget": b.kv_budget, "kv_token_capacity": b.token_capacity})
        self.metrics.set_weights(engine.state.weight_formats)
        self.metrics.update(engine.stats())

    def refusal(self) -> str | None:
        """Why a new generation request gets 503 now, or None to take it."""
        if self.async_engine.error is not None:
            return "the engine has stopped after an internal error; the server is restarting"
        if self.draining:
            return "the server is shutting down and takes no new requests"
        return None


def _default_name(cfg: EngineConfig) -> str:
    return Path(cfg.model).name if cfg.model else "gemma-3-270m-q4_k_m"
