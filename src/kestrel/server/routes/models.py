"""GET /v1/models: the one model this server serves."""

from fastapi import APIRouter, Request

from kestrel.server.protocol import ModelCard, ModelList
from kestrel.server.routes import server_state

router = APIRouter()


@router.get("/v1/models", response_model=ModelList)
async def list_models(http: Request) -> ModelList:
    return ModelList(data=[ModelCard(id=server_state(http).config.model_name)])
