"""Request-body pieces the Responses and Messages routes share: models that refuse unknown fields,
and unions of content parts told apart by their `type`."""

from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Tag


class StrictBody(BaseModel):
    """Types are strict and unknown fields are a 400 naming them: on these routes each unknown
    field is a feature of the API that kestrel does not implement, never one to skip."""

    model_config = ConfigDict(strict=True, extra="forbid")


def by_type(*members: type[BaseModel], default: str | None = None) -> Any:
    """A union of models, each with a `type: Literal[...]` field, picked by the value's `type`
    (`default` when it has none).

    Errors inside a member name the field plainly (`content[1].text`, not pydantic's
    `content[1].text.text`): the tags end in `-`, which errors.py reads as a union member's name
    and leaves out; an unknown `type` says which ones are supported."""
    tags = {member.model_fields["type"].annotation.__args__[0]: member for member in members}

    def tag(value) -> str | None:
        kind = (
            value.get("type", default) if isinstance(value, dict) else getattr(value, "type", None)
        )
        return f"{kind}-" if isinstance(kind, str) and kind in tags else None  # not a str: a 400

    union = Union[tuple(Annotated[member, Tag(f"{kind}-")] for kind, member in tags.items())]  # noqa: UP007
    message = f"unsupported type; supported: {', '.join(tags)}"
    return Annotated[
        union, Discriminator(tag, custom_error_type="invalid_type", custom_error_message=message)
    ]
