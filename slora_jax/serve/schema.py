"""Request bodies as pydantic models, for the OpenAPI schema at /openapi.json only.

The routes read their bodies by hand (protocol.py), so every error is a 400 that names its
parameter; these models describe the same fields and bounds to clients and to API fuzzers
(schemathesis), and are attached to each route with FastAPI's `openapi_extra`, which documents a
body without validating it.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from slora_jax.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS
from slora_jax.serve.protocol import (ADAPTER_NAME, INT32_MAX, MAX_BATCH_PROMPTS, MAX_MESSAGES, MAX_STOP_CHARS,
                                      MAX_N, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MESSAGE_ROLES,
                                      SEED_RANGE)

Text = Annotated[str, Field(min_length=1)]
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class StreamOptions(BaseModel):
    include_usage: bool | None = None


class SamplingFields(BaseModel):
    """What completions and chat share."""
    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="the base model's name or an adapter's; omitted: the base model")
    max_tokens: int | None = Field(None, ge=0, description="0 only with echo or prompt_logprobs")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    n: int | None = Field(None, ge=1, le=MAX_N)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Union[StopText, Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)], None] = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    return_token_ids: bool | None = None
    ttft_slo: float | None = Field(None, gt=0.0, le=3600.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(None, ge=0, description="at most max_tokens")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, description="token id (a string) -> bias added to its logit", max_length=MAX_LOGIT_BIAS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class CompletionRequest(SamplingFields):
    prompt: Union[Text, TokenIds, Annotated[list[Union[Text, TokenIds]], Field(min_length=1, max_length=MAX_BATCH_PROMPTS)]] = Field(
        ..., description="text or token ids (each below the model's vocabulary size), or a list of such prompts")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = Field(None, description="the prompt's text (and with logprobs its tokens') first")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal[MESSAGE_ROLES]
    content: Union[str, list[TextPart]] = Field(..., description="may be null for an assistant message")
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=0, description="0 only with prompt_logprobs")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class LoadAdapterRequest(BaseModel):
    lora_name: str = Field(..., pattern=ADAPTER_NAME.pattern)
    lora_path: str = Field(..., min_length=1, description="a directory under --allowed-adapter-dirs")
    load_inplace: bool | None = None


class UnloadAdapterRequest(BaseModel):
    lora_name: str = Field(..., min_length=1)


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
