"""Chat messages -> the engine's prompt, shared by chat completions, Responses and Messages.

Every route turns its request into OpenAI chat messages (`{"role", "content"}`, content a string or
a list of `text` / `image_url` parts) and builds the prompt here. Errors raised on the way name the
chat completions parameters (`messages[2].content[1]`, `max_tokens`, `stop`); `ParamNames` maps
them back to the fields the client sent (`input[1].content[1]`, `max_output_tokens`).
"""

import asyncio
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from kestrel.errors import InvalidRequestError
from kestrel.media import image_part_params
from kestrel.models.qwen_vl_processor import MultimodalPrompt, chat_prompt
from kestrel.server.reasoning import template_kwargs
from kestrel.server.tools.prompt import template_messages
from kestrel.server.tools.request import ToolUse
from kestrel.tokenizer import apply_chat_template


async def chat_template_prompt(
    state, messages: list[dict], tools: ToolUse | None = None, extra: dict | None = None
) -> list[int] | MultimodalPrompt:
    """The prompt of chat messages (and the tools offered): token ids, or a MultimodalPrompt when
    images are attached. `extra`: the template's further arguments, name -> (value, request
    field), each one the template must read (kestrel.server.reasoning.template_kwargs)."""
    images = bool(image_part_params(messages))
    kwargs = template_kwargs(state.tokenizer, extra or {}, images)
    if tools is not None:
        messages, tool_kwargs = template_messages(state.tokenizer, messages, tools, images)
        kwargs |= tool_kwargs
    try:
        if images:  # decoding and preprocessing images: off the event loop
            return await asyncio.to_thread(chat_prompt, state.processor, messages)
        return apply_chat_template(state.tokenizer, messages, **kwargs)
    except InvalidRequestError:
        raise
    except Exception as error:  # the template's own checks (role order, ...) raise jinja errors
        raise InvalidRequestError(
            f"the chat template rejected the messages: {error}", param="messages"
        ) from None


def prompt_ids(prompt: list[int] | MultimodalPrompt) -> list[int]:
    return prompt.token_ids if isinstance(prompt, MultimodalPrompt) else prompt


_MESSAGE = re.compile(r"messages\[(\d+)\]")


@dataclass
class ParamNames:
    """The client's name for each chat completions parameter: `renames` for flat ones
    (`max_tokens` -> `max_output_tokens`), `sources[i]` for chat message i (`input[3]`)."""

    renames: dict[str, str] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)

    def __call__(self, param: str | None) -> str | None:
        if param is None:
            return None
        match = _MESSAGE.match(param)
        if match and int(match[1]) < len(self.sources):
            return self.sources[int(match[1])] + param[match.end() :]
        return self.renames.get(param, param)

    @contextmanager
    def naming(self) -> Iterator[None]:
        """Re-raise InvalidRequestErrors under the client's parameter names."""
        try:
            yield
        except InvalidRequestError as error:
            param = self(error.param)
            if param == error.param:
                raise
            message = str(error).replace(error.param, param, 1)  # messages may open with it
            raise InvalidRequestError(message, param, error.code) from None
