"""The thinking in the Responses and Messages APIs' shapes (kestrel.server.reasoning splits it).

Responses: a `reasoning` output item before the message, its text as one `reasoning_text` content
part (as vLLM and OpenAI's open-weight models answer; `summary` stays empty: nothing summarizes),
streamed as response.output_item.added, response.reasoning_text.delta...,
response.reasoning_text.done and response.output_item.done. Messages: a `thinking` block before
the text (its `signature` empty: nothing signs it), streamed as a thinking block of
`thinking_delta`s.
"""

import uuid
from typing import Literal

from pydantic import BaseModel, Field


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """A Responses `reasoning` output item."""

    id: str = Field(default_factory=lambda: f"rs_{uuid.uuid4().hex}")
    type: Literal["reasoning"] = "reasoning"
    summary: list = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningItems:
    """The stream's reasoning item, made from reasoning deltas through `event(kind, **fields)`
    (the stream's numbered SSE event maker); `output` holds the response's items in order."""

    def __init__(self, event, output: list):
        self.event, self.output = event, output
        self.item: ReasoningItem | None = None

    def add(self, delta: str) -> list[str]:
        events = []
        if self.item is None:
            self.item = ReasoningItem(status="in_progress")
            self.output.append(self.item)
            added = self.item.model_dump(mode="json")
            events.append(self.event("response.output_item.added", **self._at(), item=added))
            self.item.content.append(ReasoningText(text=""))
        self.item.content[0].text += delta
        ids = {**self._at(), "item_id": self.item.id, "content_index": 0}
        return [*events, self.event("response.reasoning_text.delta", **ids, delta=delta)]

    def close(self, status: str = "completed") -> list[str]:
        if self.item is None:
            return []
        item, self.item = self.item, None
        item.status = status
        at = {"output_index": self.output.index(item)}
        ids = {**at, "item_id": item.id, "content_index": 0}
        return [
            self.event("response.reasoning_text.done", **ids, text=item.content[0].text),
            self.event("response.output_item.done", **at, item=item.model_dump(mode="json")),
        ]

    def _at(self) -> dict:
        return {"output_index": self.output.index(self.item)}


class ThinkingContent(BaseModel):
    """A Messages `thinking` content block."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ThinkingBlocks:
    """The stream's thinking block, through `event(kind, **fields)`; `blocks` counts the
    message's content blocks so far."""

    def __init__(self, event, blocks: list):
        self.event, self.blocks, self.at = event, blocks, None

    def add(self, delta: str) -> list[str]:
        events = []
        if self.at is None:
            self.at = len(self.blocks)
            self.blocks.append("thinking")
            start = ThinkingContent(thinking="").model_dump()
            events.append(self.event("content_block_start", index=self.at, content_block=start))
        delta = {"type": "thinking_delta", "thinking": delta}
        return [*events, self.event("content_block_delta", index=self.at, delta=delta)]

    def close(self) -> list[str]:
        at, self.at = self.at, None
        return [] if at is None else [self.event("content_block_stop", index=at)]
