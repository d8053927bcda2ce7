"""Request bodies as pydantic models: the shape, types and static bounds of every body the server
takes, and the request schema at /openapi.json (attached to each route with FastAPI's
`openapi_extra`, so clients and API fuzzers such as schemathesis read the same models).

The routes validate a body with `validate_body` after protocol.parse_json_body has parsed it, so
the body's size, nesting, NaN and lone-surrogate checks come first. Types are strict, as JSON
means them: true is not an integer, "5" is not a number, 1.5 is not an integer; an integer is a
number. A body that does not fit its model is a 400 in OpenAI's shape (errors.bad) whose `param`
is the path of the first field at fault in the body ("temperature", "messages[3].role",
"prompt[1]"), and whose message names that path and says what is wrong. What needs the model or
the pool (vocabulary, context length, the default max_tokens) is checked in protocol.py on the
validated model.

Fields a model does not declare stay in `model_extra` (extra="allow"): protocol.py refuses vLLM's
unimplemented ones (fields.py) and logs the rest.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Literal, TypeVar, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, ValidationError,
                      ValidationInfo, field_validator)
from pydantic_core import PydanticCustomError

from slora_jax.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS
from slora_jax.serve.errors import APIError, bad

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024        # the longest stop string
MAX_STOP_TOKEN_IDS = 64
MAX_BATCH_PROMPTS = 256      # prompts times n
MAX_N = 16
MAX_MESSAGES = 1024
INT32_MAX = 2**31 - 1        # top_k reaches the device as int32
SEED_RANGE = (-(2**63), 2**63 - 1)
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+\-]{0,255}$")
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")

STRICT = ConfigDict(strict=True)
OPEN = ConfigDict(strict=True, extra="allow")


def _past_double_as_inf(v):
    """An integer beyond a double's range as +-inf, so that it fails the field's bounds (a 400
    that says so) rather than reading as "not a number"."""
    if isinstance(v, int) and not isinstance(v, bool):
        try:
            float(v)
        except OverflowError:
            return math.inf if v > 0 else -math.inf
    return v


Number = Annotated[float, BeforeValidator(_past_double_as_inf)]


def _by_shape(pick, message: str) -> Discriminator:
    """A union whose member is picked by the JSON shape of the value (`pick` returns its tag), so
    an error comes from that member alone, at its own path; a value of no member's shape gets
    `message`."""
    return Discriminator(pick, custom_error_type="invalid_type", custom_error_message=message)


def _text_or_list(v) -> str | None:
    return "text" if isinstance(v, str) else "list" if isinstance(v, list) else None


def _prompt_shape(v) -> str | None:
    """text; a list of token ids (or of anything but text and lists: each item's error names it);
    or a batch of texts and token-id lists. A list that mixes both is none of these."""
    if isinstance(v, str):
        return "text"
    if not isinstance(v, list):
        return None
    nested = [isinstance(x, (str, list)) for x in v]
    return "ids" if not any(nested) else "batch" if all(nested) else None


Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
OnePrompt = Annotated[Union[Annotated[Text, Tag("text")], Annotated[TokenIds, Tag("list")]],
                      _by_shape(_text_or_list, "Input should be a string or a list of token ids")]
Prompt = Annotated[
    Union[Annotated[Text, Tag("text")], Annotated[TokenIds, Tag("ids")],
          Annotated[list[OnePrompt], Field(min_length=1, max_length=MAX_BATCH_PROMPTS), Tag("batch")]],
    _by_shape(_prompt_shape, "Input should be a string, a list of strings, a list of token ids or "
                                          "a list of lists of token ids")]
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = Annotated[Union[Annotated[StopText, Tag("text")],
                       Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS), Tag("list")]],
                 _by_shape(_text_or_list, "Input should be a string or a list of strings")]


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool | None = None


class SamplingFields(BaseModel):
    """What completions and chat share."""
    model_config = OPEN

    model: str | None = Field(None, description="the base model's name or an adapter's; omitted: the base model")
    max_tokens: int | None = Field(None, ge=0, description="0 only with echo or prompt_logprobs")
    temperature: Number | None = Field(None, ge=0.0, le=2.0)
    top_p: Number | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    n: int | None = Field(None, ge=1, le=MAX_N)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        None, description="each below the model's vocabulary size")
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    return_token_ids: bool | None = None
    ttft_slo: Number | None = Field(None, gt=0.0, le=3600.0)
    min_p: Number | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(None, ge=0, description="at most max_tokens")
    presence_penalty: Number | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Number | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: Number | None = Field(None, gt=0.0, le=10.0)
    logit_bias: dict[str, Annotated[Number, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, description="token id (a string, below the model's vocabulary size) -> bias added to its logit",
        max_length=MAX_LOGIT_BIAS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class CompletionRequest(SamplingFields):
    prompt: Prompt = Field(
        ..., description="text or token ids (each below the model's vocabulary size), or a list of such prompts")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = Field(None, description="the prompt's text (and with logprobs its tokens') first")


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


Content = Annotated[Union[Annotated[str, Tag("text")], Annotated[list[TextPart], Tag("list")]],
                    _by_shape(_text_or_list, "Input should be a string or a list of text parts")]


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal[MESSAGE_ROLES]
    content: Content | None = Field(None, validate_default=True,
                                    description="null or omitted only in an assistant message")
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, v, info: ValidationInfo):
        if v is None and info.data.get("role", "assistant") != "assistant":
            raise PydanticCustomError("missing", "only an assistant message may have no content")
        return v


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=0, description="0 only with prompt_logprobs")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="needs logprobs: true")


class LoadAdapterRequest(BaseModel):
    model_config = STRICT
    lora_name: str = Field(..., pattern=ADAPTER_NAME.pattern, description="not one of the base model's names")
    lora_path: str = Field(..., min_length=1, description="a directory under --allowed-adapter-dirs")
    load_inplace: bool | None = None


class UnloadAdapterRequest(BaseModel):
    model_config = STRICT
    lora_name: str = Field(..., min_length=1)


# ---------------------------------------------------------------------------------------------
# validation

M = TypeVar("M", bound=BaseModel)


def validate_body(model: type[M], body: dict) -> M:
    """`body` (parse_json_body's) as `model`; the first error in it is a 400 naming its path."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise error_of(e.errors(include_url=False, include_input=False)[0], body) from None


def error_of(err: dict, body: dict) -> APIError:
    """One pydantic error as OpenAI's 400: "messages[3].role: Input should be ...", param the path."""
    param, where = body_path(err["loc"], body)
    kind = err["type"]
    code = ("missing_required_parameter" if kind == "missing" else
            "invalid_type" if kind.endswith("_type") or kind == "invalid_type" else "invalid_value")
    return bad(f"{where}: {err['msg']}" if where else err["msg"], param or None, code)


def body_path(loc: tuple, body: dict) -> tuple[str, str]:
    """A pydantic error location as the client wrote the body: (param, where). Field names join
    with ".", list indices as "[i]"; a union member's tag, which the body does not hold, is left
    out. A map's key (logit_bias' token ids) appears as ["key"] in `where` only: `param` is the map."""
    param = where = ""
    value, in_map = body, False
    for part in loc:
        if isinstance(part, int) and isinstance(value, list):
            where += f"[{part}]"
            value = value[part] if part < len(value) else None
        elif isinstance(part, str) and isinstance(value, dict):
            if part.isidentifier():
                where += f".{part}" if where else part
            else:
                where, in_map = f"{where}[{json.dumps(part)}]", True
            value = value.get(part)
        else:
            continue
        if not in_map:
            param = where
    return param, where


def _inline(node, defs: dict):
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline(defs[ref[len("#/$defs/"):]], defs)
        return {k: _inline(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


def request_body(model: type[BaseModel]) -> dict:
    """`openapi_extra` for a route whose JSON body `model` describes (its sub-models inlined)."""
    schema = model.model_json_schema()
    schema = _inline(schema, schema.get("$defs", {}))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
