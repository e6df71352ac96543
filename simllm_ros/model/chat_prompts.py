"""The chat side of a model backend: prompts in the model's chat template (system and context first, so requests
that share them share a token prefix), the tokens that end an answer, token counts, grammars for structured output,
and answers back to text. ChatPrompts is a part ModelBackend owns: it knows only the tokenizer, the model's
generation config and the logits' rows.
"""
from __future__ import annotations

from typing import Any

from ..request import ChatTurn
from . import tool_call_formats
from .structured_output import StructuredOutput


class ChatPrompts:
    """A model's chat side: `tokenizer`, the model's `generation_config` (its end-of-sequence tokens; None where it
    has none) and `vocab_size`, the rows of its logits."""

    def __init__(self, tokenizer: Any, generation_config: Any, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = self._stop_ids(generation_config)
        self._grammars: StructuredOutput | None = None
        self._tool_format: tuple[str, str] | None = None
        self._tool_traits: tool_call_formats.TemplateTraits | None = None

    def _stop_ids(self, gen: Any) -> set[int]:
        """The tokens that end an answer: the model's and tokenizer's end of sequence, and the end-of-turn tokens."""
        ids: set[int] = set()
        for src in (getattr(gen, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(src, int):
                ids.add(src)
            elif src:
                ids.update(int(x) for x in src)
        # the end-of-turn tokens llama.cpp stops at by their text too (Llama 3's, Phi-3's), where the file's
        # eos is another token (Phi-3's <|endoftext|>, where its chat turns end with <|end|>)
        for tok in ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<eos>", "<|eot_id|>", "<|eom_id|>", "<|end|>",
                    "<|end_of_text|>", "<EOT>"):
            tid = self.tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid >= 0 and tid != self.tokenizer.unk_token_id:
                ids.add(tid)
        return ids

    # ---- prompts ---------------------------------------------------------
    def prompt_ids(self, system: str, context: str, prompt: str) -> list[int]:
        """Token ids of the chat prompt: system + context first, so requests sharing them share a prefix."""
        return self.chat_ids(system, context, [ChatTurn("user", prompt)])

    def chat_ids(self, system: str, context: str, turns: list[ChatTurn], tools=None) -> list[int]:
        """Token ids of a conversation in the model's chat template, ready for the assistant's next turn.

        One system message first: the conversation's own (a leading system turn) or `system`, then the
        context; then the turns in order. Turn N's prompt is then a token prefix of turn N+1's. tools: the tools
        the template shows the model, in its own words (only where tool_format is not generic)."""
        turns = list(turns)
        if turns and turns[0].role == "system":
            system = turns.pop(0).content
        sys_text = system if not context else (f"{system}\n\n{context}" if system else context)
        if self.tokenizer.chat_template:
            messages = ([{"role": "system", "content": sys_text}] if sys_text else []) + [
                {"role": t.role, "content": t.content} for t in turns]
            extra = {"tools": [dict(t) for t in tools]} if tools else {}
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        names = {"user": "Question", "assistant": "Answer"}
        text = (sys_text + "\n\n" if sys_text else "") + "".join(
            f"{names.get(t.role, t.role)}: {t.content}\n" for t in turns) + "Answer:"
        return self.tokenizer(text)["input_ids"]

    @property
    def tool_format(self) -> tuple[str, str]:
        """(the tool-call format of this model's chat template, why): model/tool_call_formats.detect, once."""
        if self._tool_format is None:
            template, tokens = self._tool_template()
            self._tool_format = tool_call_formats.detect(template, tokens)
        return self._tool_format

    def _tool_template(self) -> tuple[str | None, dict]:
        template = self.tokenizer.chat_template
        if isinstance(template, dict):  # named templates: the one for tools where the file has it
            template = template.get("tool_use") or template.get("default")
        tokens = {k: v for k in ("bos_token", "eos_token", "unk_token", "pad_token")  # as template_box renders
                  if isinstance(v := getattr(self.tokenizer, k, None), str)}
        return template, tokens

    @property
    def tool_traits(self) -> tool_call_formats.TemplateTraits:
        """Whether this model's template lets it think before a call, and the role tool results go back in
        (model/tool_call_formats.traits, for the template's tool format), once."""
        if self._tool_traits is None:
            template, tokens = self._tool_template()
            self._tool_traits = tool_call_formats.traits(template, self.tool_format[0], tokens)
        return self._tool_traits

    def template_changed(self) -> None:
        """Forget the tool-call format read from the chat template (the tokenizer's template was replaced)."""
        self._tool_format = None
        self._tool_traits = None

    @property
    def grammars(self) -> StructuredOutput:
        """JSON-schema grammars for this tokenizer (built at the first schema)."""
        if self._grammars is None:
            self._grammars = StructuredOutput(self.tokenizer, self.vocab_size, self.stop_ids)
        return self._grammars

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def detokenize(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True).strip()

    def tokenize_answer(self, text: str) -> list[int]:
        """Token ids of an answer text (drafts from stored answers)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
