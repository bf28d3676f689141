"""GET /: the web chat page, one static file shipped in the package (no key needed to load it)."""

from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter()


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def chat_page() -> HTMLResponse:
    return HTMLResponse(_page(), headers={"Cache-Control": "no-cache"})


@cache
def _page() -> str:
    return resources.files("kestrel.server").joinpath("static/chat.html").read_text("utf-8")
