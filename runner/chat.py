"""Rendering chat records into tokens and assistant-only loss weights.

A *renderer* turns a conversation (``[{"role", "content"}, ...]``, validated by `runner.data`)
into ``(tokens int64[N], weights float64[N])``, where ``weights[j]`` is 1.0 when token ``j`` is
a loss target (assistant content) and 0.0 otherwise; token 0 is never a target (it is no model
output). Two renderers, chosen by the tokenizer (`renderer_for`):

* `ConcatRenderer` — a tokenizer without a chat template (the built-in character tokenizer):
  BOS (when the tokenizer has one), then every message's content, concatenated. Weights are 1 on
  the trained assistant contents.
* `TemplateRenderer` — a jinja2 chat template (Hugging Face ``tokenizer_config.json``), rendered
  as ``transformers`` does (``trim_blocks``, ``lstrip_blocks``, ``raise_exception``,
  ``tojson``, ``{% generation %}`` accepted). The trained span of assistant message ``k`` is
  found by the prefix-difference method (docs/sft.md#the-input-batch): the text of
  ``messages[:k]`` with the generation prompt, ``P_k``, and the text of ``messages[:k+1]``,
  ``F_k``; the span is ``F_k[len(P_k):]`` (the content and the end-of-turn tokens, as the
  template writes them). The full text is tokenized once with character offsets, and a token is
  trained when it starts inside a trained span. A template for which ``P_k`` or ``F_k`` is not a
  prefix of the full text (history rewritten, e.g. Qwen3's thinking stripped from earlier turns)
  cannot give all-assistant masks: the error says so and names the message.

``train_on``: ``"all_assistant"`` (every assistant message) or ``"last_assistant"`` (the last
assistant message only; any messages after it are not rendered).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

import numpy as np

from runner.tokenizers import Tokenizer

TRAIN_ON = ("all_assistant", "last_assistant")
Messages = Sequence[Mapping[str, Any]]


class Renderer(Protocol):
    """Conversation → tokens (+ loss weights)."""

    def render(self, messages: Messages, *, train_on: str) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens int64[N], weights float64[N])`` for a whole conversation."""
        ...

    def prompt(self, messages: Messages) -> list[int]:
        """The tokens a policy continues from: ``messages`` then the assistant's turn opening."""
        ...


class MessageError(ValueError):
    """A message that cannot be rendered: ``index`` names it, ``detail`` says why."""

    def __init__(self, index: int, detail: str):
        super().__init__(f"messages[{index}]: {detail}")
        self.index, self.detail = index, detail


def trained_messages(messages: Messages, train_on: str) -> tuple[int, list[int]]:
    """``(how many messages to render, indices of the trained assistant messages)``."""
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}")
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant:
        raise ValueError("messages: no assistant message to train on")
    if train_on == "last_assistant":
        return assistant[-1] + 1, [assistant[-1]]
    return len(messages), assistant


class ConcatRenderer:
    """BOS + the contents, concatenated (a tokenizer without a chat template)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def _encode(self, messages: Messages, trained: Sequence[int]) -> tuple[list[int], list[float]]:
        bos = self.tokenizer.bos_id
        tokens = [] if bos is None else [bos]
        weights = [0.0] * len(tokens)
        keep = set(trained)
        for i, m in enumerate(messages):
            try:
                ids = self.tokenizer.encode(m["content"])
            except ValueError as exc:
                raise MessageError(i, str(exc)) from None
            tokens += ids
            weights += [1.0 if i in keep else 0.0] * len(ids)
        return tokens, weights

    def render(self, messages: Messages, *, train_on: str) -> tuple[np.ndarray, np.ndarray]:
        n, trained = trained_messages(messages, train_on)
        tokens, weights = self._encode(messages[:n], trained)
        return np.asarray(tokens, np.int64), np.asarray(weights, np.float64)

    def prompt(self, messages: Messages) -> list[int]:
        return self._encode(messages, ())[0]


def _environment():
    """A jinja2 environment configured as ``transformers`` renders chat templates."""
    from jinja2 import nodes
    from jinja2.exceptions import TemplateError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: rendered as its body (the masks come
        from prefix differences, not from the tag)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class TemplateRenderer:
    """A jinja2 chat template over a `Tokenizer` (module docstring for the mask rule).

    Args:
      tokenizer: the tokenizer (its ``bos_token`` / ``eos_token`` strings are template
        variables when it has them).
      template: the jinja source.

    Raises:
      ValueError: the template does not parse.
    """

    def __init__(self, tokenizer: Tokenizer, template: str):
        from jinja2.exceptions import TemplateError

        self.tokenizer = tokenizer
        try:
            self._template = _environment().from_string(template)
        except TemplateError as exc:
            raise ValueError(f"[tokenizer] chat template does not parse: {exc}") from None
        self._vars = {
            "bos_token": tokenizer.bos_token or "",
            "eos_token": tokenizer.eos_token or "",
        }

    def text(self, messages: Messages, *, add_generation_prompt: bool) -> str:
        """The template's text for ``messages``."""
        from jinja2.exceptions import TemplateError

        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **self._vars,
            )
        except TemplateError as exc:
            raise ValueError(f"the chat template failed: {exc}") from None

    def render(self, messages: Messages, *, train_on: str) -> tuple[np.ndarray, np.ndarray]:
        n, trained = trained_messages(messages, train_on)
        messages = list(messages[:n])
        full = self.text(messages, add_generation_prompt=False)
        spans = []
        for k in trained:
            head = self.text(messages[:k], add_generation_prompt=True)
            upto = self.text(messages[: k + 1], add_generation_prompt=False)
            if not (upto.startswith(head) and full.startswith(upto)):
                raise MessageError(
                    k,
                    "the chat template does not render this conversation "
                    "incrementally (the text up to an assistant message is not a prefix of the "
                    "full text), so its assistant tokens cannot be located; use "
                    '[sft].train_on = "last_assistant" or a template without rewritten history',
                )
            spans.append((len(head), len(upto)))
        ids, starts = self.tokenizer.encode_with_offsets(full)
        start_T = np.asarray(starts, np.int64)
        weights = np.zeros(len(ids), np.float64)
        for lo, hi in spans:
            weights[(start_T >= lo) & (start_T < hi)] = 1.0
        return np.asarray(ids, np.int64), weights

    def prompt(self, messages: Messages) -> list[int]:
        return self.tokenizer.encode(self.text(messages, add_generation_prompt=True))


def renderer_for(tokenizer: Tokenizer) -> Renderer:
    """`TemplateRenderer` when the tokenizer has a chat template, else `ConcatRenderer`."""
    if tokenizer.chat_template is not None:
        return TemplateRenderer(tokenizer, tokenizer.chat_template)
    return ConcatRenderer(tokenizer)
