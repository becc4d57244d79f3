"""The OpenAI-compatible protocol: request and response models, the error object, and which request fields are
served, ignored, or refused.

Field policy (docs/serving.md lists it too): a field that changes the output is either served (messages or prompt,
max_tokens or max_completion_tokens, temperature, top_p, top_k, min_p, seed, stop, stream, stream_options) or, in
REFUSED, refused with a 400 naming it unless it holds the value that asks for nothing (``n`` 1, ``logprobs`` false,
``presence_penalty`` 0, ...). Any other field is accepted and ignored (the server logs each such name once): `user`,
`metadata`, `reasoning_effort`, a message's `name`, and whatever a client adds that this server does not know, as
vLLM and llama-server do. Types of the served fields are strict: ``"max_tokens": "5"`` is a 400, not 5. No field
names a file.
"""

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits
MAX_TEMPERATURE = 2.0  # OpenAI's range
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256  # characters of one stop string

ONE_CHOICE = "one choice per request is generated (one model, batch 1)"
EXACT = "it would change the target's distribution, which decoding keeps exact"
NO_TOOLS = "tool calls are not supported"
NO_CONSTRAINTS = "constrained decoding is not supported"
# Fields that would change the output, taken only at a value that asks for nothing; any other value is a 400 saying
# why (check_refused).
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "n": ((None, 1), ONE_CHOICE),
    "best_of": ((None, 1), ONE_CHOICE),
    "use_beam_search": ((None, False), ONE_CHOICE),
    "echo": ((None, False), "the prompt is not echoed"),
    "suffix": ((None, ""), "no suffix insertion"),
    "logprobs": ((None, False, 0), "log probabilities are not returned"),
    "top_logprobs": ((None, 0), "log probabilities are not returned"),
    "prompt_logprobs": ((None, 0), "log probabilities are not returned"),
    "presence_penalty": ((None, 0), EXACT),
    "frequency_penalty": ((None, 0), EXACT),
    "repetition_penalty": ((None, 1), EXACT),
    "length_penalty": ((None, 1), EXACT),
    "logit_bias": ((None, {}), EXACT),
    "typical_p": ((None, 1), EXACT),
    "tfs_z": ((None, 1), EXACT),
    "mirostat": ((None, 0), EXACT),
    "min_tokens": ((None, 0), "the end-of-sequence token always ends an answer"),
    "ignore_eos": ((None, False), "the end-of-sequence token always ends an answer"),
    "stop_token_ids": ((None, []), "stop tokens other than the model's are not supported; use `stop` strings"),
    "bad_words": ((None, []), EXACT),
    "tools": ((None, []), NO_TOOLS),
    "tool_choice": ((None, "none", "auto"), NO_TOOLS),
    "functions": ((None, []), NO_TOOLS),
    "function_call": ((None, "none", "auto"), NO_TOOLS),
    "response_format": ((None, {"type": "text"}), "only plain text responses"),
    "guided_json": ((None,), NO_CONSTRAINTS),
    "guided_regex": ((None,), NO_CONSTRAINTS),
    "guided_choice": ((None,), NO_CONSTRAINTS),
    "guided_grammar": ((None,), NO_CONSTRAINTS),
    "grammar": ((None, ""), NO_CONSTRAINTS),
    "json_schema": ((None,), NO_CONSTRAINTS),
}
# Accepted and ignored: the output stays the same whatever they say (listed for the docs; any unknown field is too).
IGNORED = (
    "user",
    "metadata",
    "store",
    "service_tier",
    "parallel_tool_calls",
    "reasoning_effort",
    "prediction",
    "messages[].name",
)


class ApiError(Exception):
    """An error answered as OpenAI does: the HTTP status and {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _same(value: Any, expected: Any) -> bool:
    """JSON equality: 0 and 0.0 are the same, true and 1 are not."""
    if isinstance(value, bool) or isinstance(expected, bool):
        return type(value) is type(expected) and value == expected
    return value == expected


class Strict(BaseModel):
    """Unknown fields refused, types not coerced."""

    model_config = ConfigDict(extra="forbid", strict=True)


class Lenient(BaseModel):
    """Unknown fields kept aside (model_extra) to be refused (REFUSED) or ignored, types not coerced."""

    model_config = ConfigDict(extra="allow", strict=True)

    def extra_fields(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class StreamOptions(BaseModel):
    """Served: include_usage; other keys (the SDK's include_obfuscation, vLLM's continuous_usage_stats) ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class ContentPart(BaseModel):
    """One part of a message's content: a text part is served (keys beside type and text, such as cache_control,
    ignored); a part of another type is refused (ChatCompletionRequest.check_refused)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    text: str | None = None


class Message(Lenient):
    """One message; `developer` is OpenAI's newer name for `system`, a `tool` message goes to the chat template as
    it is (a template without tool messages refuses it), `name` is ignored."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Any = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text or "" for part in self.content)

    @property
    def template_role(self) -> str:
        """The role the chat template is given: system for developer."""
        return "system" if self.role == "developer" else self.role


class GenerationFields(Lenient):
    """What chat completions and completions share: the model, the sampling, the stop strings and streaming."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, ge=0, le=1)  # 0: the likeliest token alone (served as top_k 1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: every token (vLLM's and OpenAI-style clients' "off")
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("stream", mode="before")
    @classmethod
    def _null_stream_is_false(cls, value: Any) -> Any:
        return False if value is None else value

    def check_refused(self) -> None:
        """An ApiError naming the first field set to something that would change the output and that this server
        does not do (REFUSED)."""
        extra = self.extra_fields()
        for name, (allowed, why) in REFUSED.items():
            value = extra.get(name)
            if not any(_same(value, ok) for ok in allowed):
                shown = ", ".join(json.dumps(ok) for ok in allowed)
                raise ApiError(
                    400, f"'{name}' {json.dumps(value)} is not supported: {why} (accepted: {shown})", param=name
                )

    def ignored_fields(self) -> list[str]:
        """The names of the fields given that this server ignores: every one it neither serves nor refuses."""
        return [name for name in self.extra_fields() if name not in REFUSED]

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings; an ApiError for too many, empty or over-long ones."""
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stops) > MAX_STOP_STRINGS:
            raise ApiError(400, f"'stop' holds {len(stops)} strings; at most {MAX_STOP_STRINGS}", param="stop")
        if any(not stop or len(stop) > MAX_STOP_LENGTH for stop in stops):
            raise ApiError(400, f"a stop string must hold 1 to {MAX_STOP_LENGTH} characters", param="stop")
        return stops

    @property
    def token_limit(self) -> int | None:
        """max_completion_tokens or max_tokens (the same number where both are given), None where neither is."""
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ApiError(400, "'max_tokens' and 'max_completion_tokens' differ: give one", param="max_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "'stream_options' is only allowed with 'stream' true", param="stream_options")
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(GenerationFields):
    messages: list[Message] = Field(min_length=1)

    def check_refused(self) -> None:
        super().check_refused()
        for index, message in enumerate(self.messages):
            if message.tool_calls not in (None, []):
                raise ApiError(400, f"a message's 'tool_calls': {NO_TOOLS}", param=f"messages.{index}.tool_calls")
            for number, part in enumerate(message.content if isinstance(message.content, list) else ()):
                param = f"messages.{index}.content.{number}"
                if part.type != "text":
                    raise ApiError(
                        400, f"a content part of type '{part.type}' is not supported: text only", param=param
                    )
                if part.text is None:
                    raise ApiError(400, "a text part without 'text'", param=param)

    def ignored_fields(self) -> list[str]:
        names = {f"messages[].{name}" for message in self.messages for name in message.extra_fields()}
        if any(message.name is not None for message in self.messages):
            names.add("messages[].name")
        return super().ignored_fields() + sorted(names)


class CompletionRequest(GenerationFields):
    prompt: str | list[str] | list[int] | list[list[int]]

    @property
    def one_prompt(self) -> str | list[int]:
        """The prompt as text or token ids; an ApiError for several prompts (batch 1) or none."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, f"{len(prompt)} prompts given; this server takes one per request", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        return prompt


# ------------------------------------------------------------------------------------------------------ responses
class TierCounts(BaseModel):
    """One pair of tiers: how many tokens the proposer drafted and how many of them the verifier accepted."""

    proposer: str
    verifier: str
    proposed: int
    accepted: int


class TriforceUsage(BaseModel):
    """The extension of `usage`: what this request's generation kept and how each tier fared."""

    mode: str  # the tiers that ran (EngineConfig.mode): the server's, or for a prompt shorter than a retrieval chunk
    # the same without the retrieval tier
    prefix_tokens_reused: int  # prompt positions kept from the previous request's prefill (in-memory prefix reuse)
    prompt_cached: bool  # the whole prompt's prefill restored from --prompt-cache
    prefill_seconds: float
    decode_seconds: float
    stop_reason: str  # the engine's: eos, max_new_tokens, cancelled (a stop string)
    tiers: list[TierCounts]


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # OpenAI's field for prompt tokens not computed again: prefix reuse or the prompt cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    triforce: TriforceUsage


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    """What a chunk adds to the message: the role in the first, text in the others, nothing in the last."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer
    def _given(self) -> dict[str, str]:
        return {key: value for key, value in (("role", self.role), ("content", self.content)) if value is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class Completion(BaseModel):
    """A completion, or with usage None and object text_completion too, one chunk of a streamed one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "triforce"
    max_model_len: int  # the context window: prompt plus new tokens (vLLM's field of the same name)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
