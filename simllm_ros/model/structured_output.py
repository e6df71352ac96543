"""Structured output: answers constrained to a JSON schema, with xgrammar (as vLLM, SGLang and TensorRT-LLM use).

The decode loop (decoding.generate) sees one small object per request, a `JsonConstraint`:
  mask(logits, step) -> logits   tokens the grammar forbids at this point set to -inf
  accept(token)                  advance the grammar by a committed token
  is_terminated()                the grammar accepted its end (a stop token after complete JSON)
The loop applies mask() to every row it picks from, draft rows included, so a draft token the grammar
forbids is simply never the pick. The pick itself stays a function of (masked logits, step): the answer
with drafts is still bitwise the answer without them.

`StructuredOutput` holds what is built once per tokenizer (xgrammar's TokenizerInfo and GrammarCompiler,
built at the first schema, seconds including the import) and a small cache of compiled schemas. A schema is
checked first (schema_check: limits, meta-schema, recursion, keywords the grammar would ignore, spots that admit
no value); one that fails, is not JSON, that xgrammar cannot turn into a grammar, or whose grammar takes longer
than the compile budget, raises SchemaError with the reason. Compiles run on one thread of their own, so a slow
one holds that thread, not the caller's, and a schema that timed out is refused at once when it comes again.
"""
from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import re
import threading

import torch

from . import schema_check, tool_call_formats

SCHEMA_CACHE_SIZE = 32  # compiled schemas kept (a robot uses a handful)
MAX_SCHEMA_CHARS = 65536


class SchemaError(ValueError):
    """A json_schema that cannot constrain an answer; the message says why."""


class NoValueLeft(RuntimeError):
    """The grammar allows no token at this point of the answer: the schema admits no value from here (e.g. a
    pattern nothing matches). A clear error for the caller, not an internal one."""


def _clean(e: BaseException) -> str:
    """xgrammar's C++ messages start with '[time] /path/file.cc:123: ' (and sometimes a 'Check failed' line)."""
    text = str(e).strip()
    text = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", text)
    text = re.sub(r"^Check failed: .*? is false:\s*", "", text)
    return " ".join(text.split())[:300]


class JsonConstraint:
    """One request's grammar state (an xgrammar GrammarMatcher) over a vocabulary of `vocab_size` rows."""

    def __init__(self, compiled, vocab_size: int, hint: str = ""):
        import xgrammar as xgr  # deferred: xgrammar loads its native library

        self._hint = hint  # where the schema may admit nothing (its patterns), for a dead end's message
        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = int(vocab_size)
        self._bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self._shifts = torch.arange(32, dtype=torch.int32)
        self.accepted = 0  # tokens accepted so far: mask() for step n needs exactly n
        self._allowed: tuple[int, torch.Tensor] | None = None  # (step, bool [vocab]) for the current state

    def allowed(self, step: int) -> torch.Tensor:
        """Bool [vocab_size] of tokens the grammar allows as token `step` of the answer (CPU)."""
        if step != self.accepted:
            raise RuntimeError(f"grammar asked for step {step} after {self.accepted} accepted tokens")
        if self._allowed is None or self._allowed[0] != step:
            self._matcher.fill_next_token_bitmask(self._bitmask)
            words = self._bitmask[0]
            bits = (words[:, None] >> self._shifts[None, :]) & 1  # [words, 32], bit i of word w = token 32 w + i
            self._allowed = (step, bits.reshape(-1)[:self.vocab_size].bool())
            if not bool(self._allowed[1].any()):
                raise NoValueLeft(f"json_schema admits no value: no token is allowed after {step} tokens of the "
                                  f"answer{self._hint or ' (e.g. a pattern that nothing matches)'}")
        return self._allowed[1]

    def mask(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        allowed = self.allowed(step)
        n = logits.shape[-1]
        if n != self.vocab_size:
            raise RuntimeError(f"logits have {n} entries, the grammar was built for {self.vocab_size}")
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(int(token)):
            raise RuntimeError(f"token {token} is not allowed by the grammar here")
        self.accepted += 1
        self._allowed = None

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class CompiledSchema:
    """A schema checked and compiled once; `constraint()` gives each request its own grammar state."""

    def __init__(self, text: str, compiled, vocab_size: int, doc=None, wrap: tuple[str, bool, int, int] | None = None):
        self.text = text
        # (a chat template's tool-call format, text allowed, max calls, think chars): the JSON is a call inside it
        self.wrap = wrap
        self._compiled = compiled
        self.vocab_size = vocab_size
        self.doc = doc  # the parsed schema, for validating answers (schema_check.answer_error)
        paths = schema_check.pattern_paths(doc) if doc is not None else []
        self._hint = f" (check 'pattern' at {', '.join(paths[:4])})" if paths else ""

    def answer_error(self, answer: str) -> str | None:
        """None if the answer is valid under this schema, else why not."""
        if self.doc is None:
            return None
        if self.wrap is None:
            return schema_check.answer_error(answer, self.doc)
        name, text_allowed, max_calls, think_chars = self.wrap
        try:
            reading = tool_call_formats.read_answer(name, answer, text_allowed, max_calls, think_chars > 0)
        except ValueError as e:
            return str(e)
        return next((err for call in reading.calls if (err := schema_check.answer_error(call, self.doc))), None)

    def constraint(self) -> JsonConstraint:
        return JsonConstraint(self._compiled, self.vocab_size, self._hint)


class StructuredOutput:
    """JSON-schema grammars for one tokenizer. Thread-safe: prepare() compiles in callers' threads."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: set[int]):
        self._tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self._stop_ids = sorted(int(t) for t in stop_ids)
        self._compiler = None
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, CompiledSchema] = collections.OrderedDict()
        # One thread compiles: a compile past its budget keeps running there (xgrammar cannot be interrupted),
        # and its schema is refused at once if asked again.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="schema-compile")
        self._timed_out: collections.OrderedDict[str, float] = collections.OrderedDict()

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr  # deferred: xgrammar loads its native library

                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self._stop_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, schema_text: str, timeout_s: float = 2.0,
                wrap: tuple[str, bool, int, int] | None = None) -> CompiledSchema:
        """The compiled grammar of a JSON schema (cached by its text and wrap); raises SchemaError. wrap: (a chat
        template's tool-call format, text allowed, max calls, think chars; request.ToolTemplate.frame) for a
        request with tools in that format (model/tool_call_formats): the JSON is each call inside the format's
        frame, or the answer is a text reply."""
        if len(schema_text) > MAX_SCHEMA_CHARS:
            raise SchemaError(f"json_schema is {len(schema_text)} characters long; at most {MAX_SCHEMA_CHARS}")
        key = hashlib.sha256((schema_text + ("" if wrap is None else "".join(f"\x1f{w}" for w in wrap)))
                             .encode("utf-8", "surrogatepass")).hexdigest()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            if key in self._timed_out:
                raise SchemaError(f"json_schema took longer than {self._timed_out[key]:g} s to compile before; "
                                  "simplify it")
        try:
            doc = schema_check.parse(schema_text)
            schema_check.check(doc)
        except schema_check.SchemaRefused as e:
            raise SchemaError(str(e)) from None
        compiler = self._get_compiler()
        if wrap is None:
            job = self._pool.submit(compiler.compile_json_schema, schema_text, any_whitespace=False, strict_mode=True)
        else:
            job = self._pool.submit(lambda: compiler.compile_grammar(tool_call_formats.grammar(wrap[0], schema_text,
                                                                                                *wrap[1:])))
        try:
            compiled = job.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            with self._lock:
                self._timed_out[key] = timeout_s
                while len(self._timed_out) > 4 * SCHEMA_CACHE_SIZE:
                    self._timed_out.popitem(last=False)
            raise SchemaError(f"json_schema took longer than {timeout_s:g} s to compile (schema_compile_timeout_s); "
                              "simplify it") from None
        except Exception as e:  # xgrammar raises RuntimeError (and friends) with the C++ reason
            raise SchemaError(f"json_schema cannot be used: {_clean(e)}") from None
        out = CompiledSchema(schema_text, compiled, self.vocab_size, doc, wrap)
        try:
            out.constraint().allowed(0)
        except NoValueLeft:
            raise SchemaError("json_schema admits no value at all: its grammar allows no first token") from None
        with self._lock:
            self._cache[key] = out
            while len(self._cache) > SCHEMA_CACHE_SIZE:
                self._cache.popitem(last=False)
        return out
