"""The FastAPI app of `pipeline serve`, and serving it with uvicorn.

What a server is configured with (its model, engine options, shard size, upload limit) is
what `pipeline submit` takes as options: every batch it creates is a job like one submitted
from the command line, queued for the same workers.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI
from sqlalchemy.orm import Session, sessionmaker

from api import batches, errors, files, models
from api.connections import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, timed_h11
from api.limits import RequestLimits
from jobs.settings import Settings
from jobs.input.line_checks import Limits
from jobs.several_models import SeveralEngines


@dataclass(frozen=True)
class ServerConfig:
    settings: Settings
    Session: sessionmaker[Session]
    model: str                      # the jobs' model: batch lines naming another are refused
    engine_options: dict            # recorded with every job, as `pipeline submit` records them
    shard_size: int | str = "auto"   # lines a batch's shards hold (jobs.input.shard_sizing)
    limits: Limits = field(default_factory=Limits)
    served_names: tuple[str, ...] = ()   # --served-model-name: the names lines may use instead
    # --model given several times: [(model, its engine options)]; each line names one, and a
    # batch is a job of the models its lines name (jobs.several_models). None: one model.
    models: tuple[tuple[str, dict], ...] | None = None
    # A connection is closed when its request head or body does not come in time (api.connections).
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S

    @property
    def model_names(self) -> str | tuple[str, ...]:
        """What a line's body.model is checked against (jobs.input.line_checks): the served names, else
        the model; with several models, each one's names (every line must name one)."""
        return self.served_names or self.model if self.several is None else self.several.names

    @property
    def listed_models(self) -> list[str]:
        """GET /v1/models: the served names, else the model's directory's name, of each model."""
        if self.several is None:
            return list(self.served_names) or [Path(self.model).name]
        return [name for model, served in zip(self.several.models, self.several.served_names)
                for name in served or [Path(model).name]]

    @functools.cached_property
    def several(self) -> SeveralEngines | None:
        """The server's models, when it has several (their names: each line's must be one of them)."""
        return None if self.models is None else SeveralEngines(list(self.models), self.served_names)

    @property
    def max_upload_bytes(self) -> int:
        return self.settings.max_upload_bytes


def create_app(config: ServerConfig) -> FastAPI:
    # No /docs or /openapi.json: nothing is served without a key.
    app = FastAPI(title="batch-pipeline", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.config = config
    app.state.started_at = int(time.time())   # a model's `created` in /v1/models
    errors.install(app)
    app.include_router(files.router, prefix="/v1")
    app.include_router(batches.router, prefix="/v1")
    app.include_router(models.router, prefix="/v1")
    return app


def asgi_app(config: ServerConfig):
    """The app with the limits on every request body (api.limits) around it."""
    return RequestLimits(create_app(config))


def serve(config: ServerConfig, host: str, port: int) -> None:
    """Serve until SIGINT or SIGTERM (uvicorn finishes the requests in flight first), after
    removing what an earlier server killed mid-upload left behind."""
    import logging

    import uvicorn

    removed = files.sweep_leftovers(config.Session, config.settings.data_dir)
    if removed:
        logging.getLogger(__name__).warning("removed %d file(s) left by an interrupted upload", removed)

    # timeout_keep_alive: an idle connection is closed 5 s after its last response; h11 bounds
    # the headers (16 KiB); api.connections closes a request whose head or body does not come.
    uvicorn.run(asgi_app(config), host=host, port=port, log_level="info", access_log=True, timeout_keep_alive=5,
                http=timed_h11(config.header_timeout_s, config.body_timeout_s))
