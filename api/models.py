"""/v1/models: the names batches may give the server's model (`--served-model-name`), so
that the openai client's `models.list()` and `models.retrieve()` work."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from api.auth import caller
from api.errors import not_found
from jobs import ledger

router = APIRouter()


def _model(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "batch-pipeline"}


@router.get("/models")
def list_models(request: Request, key: ledger.ApiKey = Depends(caller)):
    config = request.app.state.config
    return {"object": "list", "data": [_model(name, request.app.state.started_at) for name in config.listed_models]}


@router.get("/models/{model_id}")
def retrieve_model(request: Request, model_id: str, key: ledger.ApiKey = Depends(caller)):
    config = request.app.state.config
    if model_id not in config.listed_models:
        raise not_found("Model", model_id, param="model")
    return _model(model_id, request.app.state.started_at)
