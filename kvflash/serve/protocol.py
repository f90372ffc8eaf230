"""The bodies of the OpenAI API as this server speaks it: the requests of its two routes (pydantic
checks every field, so a bad one is refused with a 400 that names it), the shape of their answers,
and the error body.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

if TYPE_CHECKING:
    from kvflash.serve.turn import TurnStats


def _utf8(text: str) -> str:
    """JSON can carry lone surrogates (`"\\ud800"`), which are no text: refused as bad input."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode text ({e.reason} at {e.start})") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]
MAX_STOPS = 16
MAX_STOP_CHARS = 256
"""Stop strings are searched for at every token: their number and length are bounded."""
StopString = Annotated[Text, Field(max_length=MAX_STOP_CHARS)]


def _only(why: str, *off: object) -> AfterValidator:
    """A field of OpenAI's that kvflash does not honour: taken null or at a value that asks for
    nothing of it (`off`), else refused with `why`, so that a client never gets an answer that
    silently lacks what it asked for."""

    def check(value: object) -> object:
        if value is not None and not any(value == o and type(value) is type(o) for o in off):
            raise ValueError(why)
        return value

    return AfterValidator(check)


NO_LOGPROBS = "kvflash does not return log probabilities"
NO_TOOLS = "kvflash does not call tools or functions"
TEXT_ONLY = 'kvflash answers in plain text only (response_format {"type": "text"})'


class Strict(BaseModel):
    """A request body's part: a field of another JSON type is refused, not converted (`"stream":
    "yes"`, `"max_tokens": "5"` or `5.5` are 400s, as the schema they are declared in says); an
    integer where a number is asked for is a number, and a whole number (`5.0`) an integer."""

    model_config = ConfigDict(strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _whole(cls, value: object) -> object:
        """JSON Schema's integer is any number whose fractional part is zero: 5.0 is one (as the
        schema generated from these models says), 5.5 is not."""
        return int(value) if isinstance(value, float) and value.is_integer() else value


class TextPart(Strict):
    type: Literal["text"]
    text: Text


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]

    def as_template_message(self) -> dict[str, str]:
        """`developer` is the newer name of `system`; text parts are joined."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class StreamOptions(Strict):
    include_usage: bool = False


class Sampled(Strict):
    """The fields the chat and the text completion requests share; others are ignored."""

    model: Text
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = None
    """Any integer: the sampler's generator takes it modulo 2**64 (`sampling_seed`). Bounds at
    ±2**63 would be where JSON readers that compare in doubles and this one disagree."""
    min_tokens: int = Field(0, ge=0, lt=2**31)
    """vLLM's extension: the end-of-sequence ids are not sampled before this many tokens."""
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = None
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None

    def sampling_seed(self) -> int | None:
        return None if self.seed is None else self.seed % 2**64

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def asked_tokens(self) -> int | None:
        """The answer's most tokens as the request asks, or None where it leaves them to the server."""
        return self.max_tokens


class MessageSpan(Strict):
    """Characters [start, end) of one message's content (the whole content by default)."""

    message: int = Field(ge=0)
    start: int = Field(0, ge=0)
    end: int | None = Field(None, ge=1)


MAX_PINS = 64
Pin = Literal["system", "last-turn"] | MessageSpan


class Extras(Strict):
    """The `kvflash` field of a chat request: what only this server does."""

    pin: list[Pin] = Field(default_factory=list, max_length=MAX_PINS)
    """Spans whose chunks stay on the GPU whatever the residency policy selects: `system` (every
    system message), `last-turn` (the previous question and its answer) or a message's characters."""


class ChatRequest(Sampled):
    """OpenAI's chat completion request, as far as kvflash honours it, and kvflash's own `kvflash`."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    kvflash: Extras = Field(default_factory=Extras)
    logprobs: Annotated[object, _only(NO_LOGPROBS, False)] = None
    top_logprobs: Annotated[object, _only(NO_LOGPROBS, 0)] = None
    tools: Annotated[object, _only(NO_TOOLS, [])] = None
    tool_choice: Annotated[object, _only(NO_TOOLS, "none", "auto")] = None
    functions: Annotated[object, _only(NO_TOOLS, [])] = None
    function_call: Annotated[object, _only(NO_TOOLS, "none", "auto")] = None
    response_format: Annotated[object, _only(TEXT_ONLY, {"type": "text"})] = None

    def asked_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


COMPLETION_TOKENS = 16
"""OpenAI's default answer length for a text completion (`max_tokens` absent or null)."""


class CompletionRequest(Sampled):
    """OpenAI's (legacy) text completion request: one prompt string, its continuation back."""

    prompt: Text = Field(min_length=1)
    max_tokens: int | None = Field(COMPLETION_TOKENS, ge=1)
    logprobs: Annotated[object, _only(NO_LOGPROBS)] = None
    echo: Annotated[object, _only("kvflash does not echo the prompt", False)] = None
    best_of: Annotated[object, _only("kvflash gives one answer a request (best_of 1)", 1)] = None
    suffix: Annotated[object, _only("kvflash does not insert text (no suffix)", "")] = None

    def asked_tokens(self) -> int:
        return self.max_tokens or COMPLETION_TOKENS


@dataclass
class Completion:
    """A request's answer as the routes send it: its text, why it ended, its token counts and the
    turn's stats."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: TurnStats

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.stats.restored_tokens},
        }


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


@dataclass(frozen=True)
class Shape:
    """How one route's answers look: the object names and a choice's text field."""

    prefix: str
    whole: str
    """The object of an unstreamed answer."""
    part: str
    """The object of a streamed chunk."""
    param: str
    """The request field a bad prompt is blamed on."""

    def choice(self, text: str, finish: str | None, first: bool = False, streamed: bool = False) -> dict:
        if self is CHAT:
            if not streamed:
                body = {"message": {"role": "assistant", "content": text}}
            else:
                body = {
                    "delta": {"role": "assistant", "content": ""}
                    if first
                    else {"content": text}
                    if text
                    else {}
                }
        else:
            body = {"text": text}
        return {"index": 0, **body, "finish_reason": finish, "logprobs": None}


CHAT = Shape("chatcmpl", "chat.completion", "chat.completion.chunk", "messages")
TEXT = Shape("cmpl", "text_completion", "text_completion", "prompt")
