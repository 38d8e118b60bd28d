"""The HTTP API's wire format: OpenAI's completions request and response, our extensions, and OpenAI-style errors.

Requests are pydantic models in strict mode with unknown fields forbidden: a misspelt or unsupported field is a 400
that names it, never silently dropped. Responses are plain dicts in OpenAI's shape (`completion`, `chunk`), which
the `openai` client parses.

Extensions, all optional (vLLM's names where vLLM has the parameter): `session_id` (continue a session's memory),
`top_k`, `min_p`, `repetition_penalty`, `no_repeat_ngram_size`, `min_tokens`, `stop_token_ids`, `ban_unk` (true:
never sample the vocabulary's `<unk>`), `grammar` (a music model's representation, "remi" or "remi-xl": only the
events its grammar allows next are sampled, so its MIDI writer places every one), `return_token_ids` (each
choice then carries `token_ids`, the generated token ids), and HuggingFace's beam search settings `num_beams`,
`length_penalty` and `early_stopping` (n then is how many of the best beams come back; beams.py).
"""

from __future__ import annotations

import secrets
import time
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from txl_deploy.errors import TxlError

SESSION_ID_PATTERN = r"^[A-Za-z0-9._-]{1,128}$"


class ApiError(TxlError):
    """An error the API answers with: an HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """POST /v1/completions. OpenAI's fields, then our extensions."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = 16
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = None
    echo: bool | None = False
    stop: Union[str, list[str], None] = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    seed: int | None = None
    suffix: str | None = None
    # extensions
    session_id: str | None = Field(default=None, pattern=SESSION_ID_PATTERN)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    no_repeat_ngram_size: int | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    return_token_ids: bool | None = False
    ban_unk: bool | None = None
    grammar: str | None = None
    # beam search (TxlRuntime.beam_search, HuggingFace's rules): n is then how many of the best beams come back
    num_beams: int | None = None
    length_penalty: float | None = None
    early_stopping: Union[bool, Literal["never"], None] = None

    def unsupported(self) -> ApiError | None:
        """OpenAI fields this server cannot honour, set to anything but their no-op values."""
        if self.num_beams is not None or self.length_penalty is not None or self.early_stopping is not None:
            return self._beam_refusal()
        n, rows = (1 if self.n is None else self.n), self.rows
        if n < 1 or rows < n:
            return ApiError(400, f"n must be at least 1 and best_of at least n, got n {self.n} and best_of "
                                 f"{self.best_of}", param="n" if n < 1 else "best_of")
        if rows > 1 and self.session_id is not None:
            return ApiError(400, "n and best_of above 1 take no session_id: fork the session "
                                 "(POST /v1/sessions/ID/fork) and continue each fork instead", param="session_id")
        if rows > 1 and self.echo:
            return ApiError(400, "echo takes n and best_of of 1", param="echo")
        if rows > n and self.stream:
            return ApiError(400, "best_of above n cannot be streamed (the best are known only at the end)",
                            param="best_of")
        if self.suffix:
            return ApiError(400, "suffix is not supported (a language model continues text, it does not insert)",
                            param="suffix")
        if self.stream_options is not None and not self.stream:
            return ApiError(400, "stream_options needs stream: true", param="stream_options")
        return None

    def _beam_refusal(self) -> ApiError | None:
        """A beam search request may set only what the search takes; anything else would be silently ignored."""
        if self.num_beams is None:
            param = "length_penalty" if self.length_penalty is not None else "early_stopping"
            return ApiError(400, f"{param} needs num_beams (it applies to beam search only)", param=param)
        other = sorted(self.model_fields_set - BEAM_FIELDS)
        if other:
            return ApiError(400, f"{other[0]} does not apply to beam search (num_beams): it takes "
                                 f"{', '.join(sorted(BEAM_FIELDS - {'prompt', 'model', 'user'}))}", param=other[0])
        if self.num_beams < 2 or not 1 <= (self.n or 1) <= self.num_beams:
            return ApiError(400, f"num_beams must be at least 2 and n (the beams returned) in [1, num_beams], got "
                                 f"num_beams {self.num_beams} and n {self.n}",
                            param="num_beams" if self.num_beams < 2 else "n")
        return None

    @property
    def rows(self) -> int:
        """The completions this request samples (best_of, else n), each a row of its own."""
        return self.best_of if self.best_of is not None else (1 if self.n is None else self.n)

    def sampling_kwargs(self) -> dict:
        """The SamplingParams keyword arguments this request sets (None: the default)."""
        fields = ("max_tokens", "temperature", "top_p", "logprobs", "stop", "presence_penalty", "frequency_penalty",
                  "logit_bias", "seed", "top_k", "min_p", "repetition_penalty", "no_repeat_ngram_size", "min_tokens",
                  "stop_token_ids", "ban_unk")
        return {f: getattr(self, f) for f in fields if getattr(self, f) is not None}


# what a beam search request may send: the search's own settings, and the prompt, its length and stop ids
BEAM_FIELDS = frozenset({"model", "prompt", "max_tokens", "n", "num_beams", "length_penalty", "early_stopping",
                         "stop_token_ids", "return_token_ids", "user"})


class SessionCreate(BaseModel):
    """POST /v1/sessions: an id of the client's choosing, or none (the server makes one)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str | None = Field(default=None, pattern=SESSION_ID_PATTERN)


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def logprobs_part(tokens: list[dict]) -> dict:
    """OpenAI's completions `logprobs` object for these tokens (each: piece, logprob, top, offset)."""
    return {"tokens": [t["piece"] for t in tokens], "token_logprobs": [t["logprob"] for t in tokens],
            "top_logprobs": [t["top"] for t in tokens], "text_offset": [t["offset"] for t in tokens]}


def completion(id_: str, model: str, text: str, finish_reason: str | None, usage: dict, tokens: list[dict] | None,
               token_ids: list[int] | None, session_id: str | None, index: int = 0) -> dict:
    choice = {"text": text, "index": index, "logprobs": None if tokens is None else logprobs_part(tokens),
              "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    out = {"id": id_, "object": "text_completion", "created": int(time.time()), "model": model,
           "choices": [choice], "usage": usage}
    if session_id is not None:
        out["session_id"] = session_id
    return out


def with_choices(responses: list[dict]) -> dict:
    """One response holding the choices of several `completion(...)` answers, in the order given."""
    out = responses[0]
    for more in responses[1:]:
        out["choices"] += more["choices"]
    return out


def chunk(id_: str, model: str, created: int, text: str, finish_reason: str | None, tokens: list[dict] | None,
          token_ids: list[int] | None, index: int = 0) -> dict:
    choice = {"text": text, "index": index, "logprobs": None if tokens is None else logprobs_part(tokens),
              "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": id_, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def usage_chunk(id_: str, model: str, created: int, usage: dict) -> dict:
    return {"id": id_, "object": "text_completion", "created": created, "model": model, "choices": [],
            "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


FinishReason = Literal["stop", "length"]
