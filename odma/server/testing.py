"""A real odma-serve (uvicorn in a thread) over a tiny random model with SmolLM2's tokenizer, for tests: no
download, seconds to start."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Iterator

from odma.config import PoolConfig
from odma.engine import EngineConfig, LLMEngine
from odma.engine.length_predictor import LoadedPredictor
from odma.server.app import create_app
from odma.server.generation_config import SamplingDefaults
from odma.server.metrics import Metrics
from odma.server.runtime import AsyncEngine
from odma.server.threaded import ThreadedServer

MODEL = "tiny"


def tiny_model_folder(folder: str | Path) -> Path:
    """A tiny Llama with SmolLM2's vocabulary and its tokenizer saved beside it (so chat templates work)."""
    from odma.models.tiny import make_tiny_model
    from odma.tokenizer import load_tokenizer

    folder = make_tiny_model(folder, "llama", vocab_size=49152, eos_token_id=2, max_position_embeddings=4096)
    load_tokenizer("smollm2").hf.save_pretrained(str(folder))
    return folder


def _base_config(folder: str | Path) -> EngineConfig:
    return EngineConfig(model=str(folder), kv_budget="8MiB", length_log=None, predictor="median", max_tokens_cap=64,
                        default_max_tokens=16, threads=1, pool=PoolConfig(align=16))


@contextmanager
def tiny_server(folder: str | Path, *, predictor=None, defaults: SamplingDefaults | None = None, max_queue: int = 64,
                max_n: int = 4, wrap=None, **config) -> Iterator[ThreadedServer]:
    """A started server over `folder` (from `tiny_model_folder`); `srv.url`, `srv.runtime`. `predictor`: an
    object with `predict(requests)` replacing the running median; `wrap`: an ASGI middleware around the app
    (`wrap(app)`); `config`: EngineConfig fields."""
    from odma.models import load_model

    engine_config = replace(_base_config(folder), **config)
    metrics = Metrics()
    loaded = LoadedPredictor(predictor, getattr(predictor, "name", "test"), None) if predictor is not None else None
    from transformers import AutoTokenizer

    engine = LLMEngine(engine_config, model=load_model(folder), tokenizer=AutoTokenizer.from_pretrained(str(folder)),
                       predictor=loaded, metrics=metrics)
    runtime = AsyncEngine(engine, max_queue=max_queue)
    metrics.attach(runtime)
    app = create_app(runtime, metrics, MODEL, defaults=defaults, max_n=max_n)
    with ThreadedServer(wrap(app) if wrap is not None else app) as srv:
        srv.runtime = runtime
        srv.app = app
        yield srv
    runtime.close()


@contextmanager
def tiny_process_server(folder: str | Path, *, max_queue: int = 64, max_n: int = 4,
                        **config) -> Iterator[ThreadedServer]:
    """`tiny_server` with the engine in its own process (`--engine-process`), over the same config; the engine
    process loads `folder` itself. `srv.runtime` is the `ProcessRuntime`."""
    from odma.server.engine_process import build_process_server

    app, runtime = build_process_server(replace(_base_config(folder), **config), max_queue, MODEL, generation_config="auto",
                                        override_generation_config=None, max_n=max_n, log_level="warning")
    try:
        with ThreadedServer(app) as srv:
            srv.runtime = runtime
            srv.app = app
            yield srv
    finally:
        runtime.close()


def leave_early(url: str, body: dict, *, timeout: float) -> None:
    """POST a completion `body` and hang up: a stream after its first chunk, else when `timeout` passes with no
    answer (which must: an answer in time raises AssertionError, the work asked for being too short to leave)."""
    import httpx

    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
            for line in r.iter_lines():
                if body.get("stream") and line.startswith("data:"):
                    return  # one chunk, then hang up
    except httpx.ReadTimeout:
        if not body.get("stream"):
            return
        raise
    raise AssertionError("the answer came whole before the client left")
