"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes and bodies): LoRA
adapters loaded and unloaded while the server runs, behind the API key like every /v1 route. A
bad adapter is a 400 naming the problem; the engine and its other adapters go on serving."""

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from kestrel.server.errors import APIError
from kestrel.server.protocol import LoadLoRARequest, UnloadLoRARequest
from kestrel.server.routes import ERROR_RESPONSES, server_state

router = APIRouter()


@router.post("/v1/load_lora_adapter", responses=ERROR_RESPONSES)
async def load_lora_adapter(body: LoadLoRARequest, http: Request) -> PlainTextResponse:
    state = server_state(http)
    engine = state.ready_engine()
    name = body.lora_name
    if name == state.config.model_name or name in state.config.aliases:
        raise APIError(400, f"{name!r} is the base model's name", param="lora_name")
    if name in engine.adapters:
        raise APIError(400, f"adapter {name!r} is already loaded", param="lora_name")
    await engine.load_lora(name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", responses=ERROR_RESPONSES)
async def unload_lora_adapter(body: UnloadLoRARequest, http: Request) -> PlainTextResponse:
    engine = server_state(http).ready_engine()
    name = body.lora_name
    if name not in engine.adapters:
        raise APIError(404, f"no adapter {name!r} is loaded", param="lora_name", code="not_found")
    await engine.unload_lora(name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
