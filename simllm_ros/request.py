"""Request and result records shared by the core engine and the ROS layer.

They mirror srv/Query.srv field for field so the ROS layer is a plain copy, and
the core can be tested and benchmarked without ROS.
"""
from __future__ import annotations

import dataclasses
import enum
import math

DEFAULT_SCOPE = "default"  # the pool's name for the shared scope of requests with an empty cache_scope


class CacheResult(enum.IntEnum):
    """Which reuse tier answered; values are the Query.srv constants."""

    MISS = 0
    EXACT_PREFIX = 1
    SEMANTIC = 2
    ANSWER = 3


ROLES = ("system", "user", "assistant")
CANCELLED_ERROR = "cancelled by the caller"


@dataclasses.dataclass(frozen=True)
class ChatTurn:
    """One turn of a conversation (msg/ChatMessage): role is system, user or assistant."""

    role: str
    content: str


@dataclasses.dataclass(frozen=True)
class ToolResultTurn(ChatTurn):
    """A tool's result given back to the model (role: the one its chat template maps, "tool" or "ipython";
    model/tool_call_formats.traits). Made by the node after it ran a call, never from a request's message: a
    request's own turns may only be system, user or assistant."""


@dataclasses.dataclass(frozen=True)
class ToolTemplate:
    """Tools given to the model's chat template (apply_chat_template(tools=...)) and the template's own tool-call
    format its answer is constrained to, around json_schema (model/tool_call_formats.py). Set by the node's tools
    (serving/tool_output_formats.py), never by a request message."""

    format: str  # hermes | llama3_json
    tools: tuple = ()  # {"type": "function", "function": {name, description, parameters}} per tool
    text_allowed: bool = False  # tool_choice auto: a text reply, or a call
    max_calls: int = 1  # the answer may make 1..max_calls calls (the node's tool_max_calls)
    think_chars: int = 0  # > 0: a <think> block of at most this many characters may come first (the template's)

    @property
    def frame(self) -> tuple[str, bool, int, int]:
        """What the grammar wraps around the calls' schema (model/tool_call_formats.grammar's arguments)."""
        return (self.format, self.text_allowed, self.max_calls, self.think_chars)


@dataclasses.dataclass
class QueryRequest:
    prompt: str
    context: str = ""
    cache_scope: str = ""
    max_new_tokens: int = 0
    allow_approximate: bool = True
    request_id: str = ""
    # The conversation so far (earliest first); a non-empty prompt is its final user turn.
    messages: list[ChatTurn] = dataclasses.field(default_factory=list)
    json_schema: str = ""  # non-empty: the answer is JSON valid under this schema
    stop: list[str] = dataclasses.field(default_factory=list)  # the answer ends before the first of these
    temperature: float | None = None  # None: the node's temperature
    seed: int | None = None  # None: the node's seed
    approx_error_bound: float = -1.0  # δ for this request's approximate answers; negative: the node's
    tool_template: ToolTemplate | None = None  # tools in the chat template's own format (the node's tools only)

    @property
    def scope(self) -> str:
        """The pool's scope: an empty cache_scope is the shared scope DEFAULT_SCOPE. A request that names
        "default" itself is refused by validation, so the two can never meet."""
        return self.cache_scope or DEFAULT_SCOPE

    def turns(self) -> list[ChatTurn]:
        """The conversation the model answers: messages, then the prompt as a user turn (when given)."""
        return list(self.messages) + ([ChatTurn("user", self.prompt)] if self.prompt else [])

    @property
    def question(self) -> str:
        """What is asked now: the prompt, or the last user turn of the messages."""
        if self.prompt:
            return self.prompt
        return next((t.content for t in reversed(self.messages) if t.role == "user"), "")


@dataclasses.dataclass(frozen=True)
class Progress:
    """The answer so far, for a streaming transport (the action's feedback)."""

    text: str
    generated_tokens: int
    cache_result: CacheResult


@dataclasses.dataclass
class ToolCallRecord:
    """A call the model made and what the node did with it (msg/ToolCall): status refused, dry_run,
    not_executable, executed, failed or canceled; arguments and result as JSON."""

    name: str
    arguments: str
    status: str
    result: str = ""
    error: str = ""


@dataclasses.dataclass
class QueryResult:
    success: bool
    error: str = ""
    answer: str = ""
    cache_result: CacheResult = CacheResult.MISS
    similarity: float = 0.0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    generated_tokens: int = 0
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    request_id: str = ""
    # True when the answer is guaranteed to be what the model answers with an empty pool (bitwise):
    # MISS, lossless EXACT_PREFIX reuse and verified drafts on a batch-invariant backend.
    exact: bool = False
    draft_tokens_proposed: int = 0  # draft tokens checked by the model (verified decoding)
    draft_tokens_accepted: int = 0  # of those, tokens the model agreed with and kept
    decode_passes: int = 0  # forward passes after the prefill
    decode_passes_saved: int = 0  # against plain decoding of the same tokens (statistics only, not in the message)
    # Why the answer ended: "eos" (the model ended it), "length" (max_new_tokens), "stop" (a stop string),
    # "cancel" (the caller cancelled), "" (no generation: a refusal or an ANSWER hit).
    stop_reason: str = ""
    # The 95% upper bound on the chance that this answer differs from the model's own, for an approximate answer
    # served under approx_error_bound; 0 for an exact one (and for approximate ones served with no bound asked).
    error_estimate: float = 0.0
    # Joules the computer drew while the engine ran this request (shared with requests in flight together); NaN
    # where it cannot be known, and then energy_source says why ("none: <why>"), else it names the sensor.
    energy_j: float = math.nan
    energy_source: str = "none: not measured (the request never ran)"
    tool_calls: list[ToolCallRecord] = dataclasses.field(default_factory=list)  # requests with tools
    # A <think> block the model wrote before its calls (a template that lets it think): its reasoning, not the
    # answer; "" without one. In the response's `reasoning` field, and on the tool audit's "proposed" events.
    reasoning: str = ""

    @classmethod
    def failure(cls, error: str, request_id: str = "") -> "QueryResult":
        return cls(success=False, error=error, request_id=request_id)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["cache_result"] = CacheResult(self.cache_result).name
        return d
