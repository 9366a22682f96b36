"""The tokenizer as the engine sees it: HF `tokenizers` plus special ids and a sandboxed chat template."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any, ClassVar

from jinja2 import TemplateError, nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


class ChatTemplateError(ValueError):
    """The chat template is missing, malformed, raised an error, or tried to escape the sandbox."""


def _raise_exception(message: str) -> None:
    # A template's own refusal (Gemma: no system role; roles that do not alternate).
    raise ChatTemplateError(f"the chat template refuses these messages: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' `tojson` (templates call it with these keywords); Jinja's own escapes HTML.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's tokens for training masks
    (transformers); rendering a prompt keeps the body as it is."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _compile_template(source: str):
    # A chat template is untrusted input (GGUF files come from strangers): render it in Jinja's
    # immutable sandbox, which refuses attribute access to Python internals and mutation. The
    # rest is what transformers gives templates: trimmed blocks, break/continue, raise_exception,
    # strftime_now, tojson.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag]
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e


class Tokenizer:
    """Encode/decode and chat formatting. `hf` is the underlying `tokenizers.Tokenizer`."""

    def __init__(
        self,
        hf: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos_token: bool,
        chat_template: str | None,
    ) -> None:
        self.hf = hf
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self._template = _compile_template(chat_template) if chat_template else None
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self.special_token_ids = frozenset(
            tid for tid, tok in hf.get_added_tokens_decoder().items() if tok.special
        )

    def __getstate__(self) -> dict[str, Any]:
        # The compiled template does not pickle (the server's engine process sends the tokenizer
        # to the front end); its source does, and is compiled again on arrival.
        state = self.__dict__.copy()
        state["_template"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.chat_template:
            self._template = _compile_template(self.chat_template)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def token_to_str(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def set_chat_template(self, source: str) -> None:
        self._template = _compile_template(source)
        self.chat_template = source

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        if self._template is None:
            raise ChatTemplateError(
                "this model has no chat template; pass one with --chat-template FILE"
            )
        bos = self.token_to_str(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.token_to_str(self.eos_token_id) if self.eos_token_id is not None else ""
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=bos or "",
                eos_token=eos or "",
                **extra,
            )
        except SecurityError as e:
            raise ChatTemplateError(f"chat template refused by the sandbox: {e}") from e
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise ChatTemplateError(f"chat template failed to render: {e}") from e
