"""Structured output: answers constrained to a JSON schema, with xgrammar (as vLLM, SGLang and TensorRT-LLM use).

The decode loop (decoding.generate) sees one small object per request, a `JsonConstraint`:
  mask(logits, step) -> logits   tokens the grammar forbids at this point set to -inf
  accept(token)                  advance the grammar by a committed token
  is_terminated()                the grammar accepted its end (a stop token after complete JSON)
The loop applies mask() to every row it picks from, draft rows included, so a draft token the grammar
forbids is simply never the pick. The pick itself stays a function of (masked logits, step): the answer
with drafts is still bitwise the answer without them.

`StructuredOutput` holds what is built once per tokenizer (xgrammar's TokenizerInfo and GrammarCompiler,
built at the first schema, ~2 s including the import) and a small cache of compiled schemas. A schema
that is not JSON, or that xgrammar cannot turn into a grammar, raises SchemaError with the reason.
"""
from __future__ import annotations

import collections
import json
import re
import threading

import torch

SCHEMA_CACHE_SIZE = 32  # compiled schemas kept (a robot uses a handful)
MAX_SCHEMA_CHARS = 65536


class SchemaError(ValueError):
    """A json_schema that cannot constrain an answer; the message says why."""


def _clean(e: BaseException) -> str:
    """xgrammar's C++ messages start with '[time] /path/file.cc:123: ' (and sometimes a 'Check failed' line)."""
    text = str(e).strip()
    text = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", text)
    text = re.sub(r"^Check failed: .*? is false:\s*", "", text)
    return " ".join(text.split())[:300]


class JsonConstraint:
    """One request's grammar state (an xgrammar GrammarMatcher) over a vocabulary of `vocab_size` rows."""

    def __init__(self, compiled, vocab_size: int):
        import xgrammar as xgr

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

    def __init__(self, text: str, compiled, vocab_size: int):
        self.text = text
        self._compiled = compiled
        self.vocab_size = vocab_size

    def constraint(self) -> JsonConstraint:
        return JsonConstraint(self._compiled, self.vocab_size)


class StructuredOutput:
    """JSON-schema grammars for one tokenizer. Thread-safe: prepare() compiles in callers' threads."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: set[int]):
        self._tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self._stop_ids = sorted(int(t) for t in stop_ids)
        self._compiler = None
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, CompiledSchema] = collections.OrderedDict()

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self._stop_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, schema_text: str) -> CompiledSchema:
        """The compiled grammar of a JSON schema (cached by its text); raises SchemaError."""
        if len(schema_text) > MAX_SCHEMA_CHARS:
            raise SchemaError(f"json_schema is {len(schema_text)} characters long; at most {MAX_SCHEMA_CHARS}")
        with self._lock:
            hit = self._cache.get(schema_text)
            if hit is not None:
                self._cache.move_to_end(schema_text)
                return hit
        try:
            parsed = json.loads(schema_text)
        except ValueError as e:
            raise SchemaError(f"json_schema is not valid JSON: {e}") from None
        if not isinstance(parsed, (dict, bool)):
            raise SchemaError(f"json_schema must be a JSON object (a schema), got {type(parsed).__name__}")
        compiler = self._get_compiler()
        try:
            compiled = compiler.compile_json_schema(schema_text, any_whitespace=False, strict_mode=True)
        except Exception as e:  # xgrammar raises RuntimeError (and friends) with the C++ reason
            raise SchemaError(f"json_schema cannot be used: {_clean(e)}") from None
        out = CompiledSchema(schema_text, compiled, self.vocab_size)
        with self._lock:
            self._cache[schema_text] = out
            while len(self._cache) > SCHEMA_CACHE_SIZE:
                self._cache.popitem(last=False)
        return out
