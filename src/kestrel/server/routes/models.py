"""GET /v1/models and /v1/models/{id}: the one model this server serves, under its names."""

from fastapi import APIRouter, Request

from kestrel.server.protocol import ModelCard, ModelList
from kestrel.server.routes import ERROR_RESPONSES, server_state
from kestrel.server.state import ServerState

router = APIRouter()


@router.get("/v1/models", response_model=ModelList)
async def list_models(http: Request) -> ModelList:
    state = server_state(http)
    return ModelList(data=[_card(state), *_adapter_cards(state)])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERROR_RESPONSES)
async def retrieve_model(model_id: str, http: Request) -> ModelCard:
    """The model under any of its names (as `client.models.retrieve` asks); else 404."""
    state = server_state(http)
    served_model(state, model_id)
    adapters = {card.id: card for card in _adapter_cards(state)}
    return adapters.get(model_id) or _card(state)


def served_model(state: ServerState, requested: str | None) -> str:
    """The name a response carries: the request's own (404 unless it names this model), or the
    served name when the request gave none (as llama-server and vLLM)."""
    if requested is None:
        return state.config.model_name
    state.check_model(requested)
    return requested


def _adapter_cards(state: ServerState) -> list[ModelCard]:
    """The loaded LoRA adapters, each with the base model as its `parent` (vLLM's cards)."""
    adapters = state.engine.adapters if state.engine is not None else {}
    base = state.config.model_name
    return [ModelCard(id=name, parent=base, root=path) for name, path in sorted(adapters.items())]


def _card(state: ServerState) -> ModelCard:
    config = state.config
    return ModelCard(id=config.model_name, aliases=sorted(config.aliases - {config.model_name}))
