"""Chat templates for model files that ship none, by architecture.

A file's own template (GGUF `tokenizer.chat_template`, tokenizer_config.json) always wins; this is
only for families whose turn format is fixed and known, so that such a file still chats. Gemma
GGUFs converted without their template are the case in point.
"""

from __future__ import annotations

# Gemma's turns: "<start_of_turn>user\n...<end_of_turn>\n", the assistant called "model". It has no
# system role: a system message is put at the head of the first user turn. Roles must alternate
# user/model after it; anything else is refused with the reason (as Gemma's own template does).
GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set prefix = messages[0]['content'] | trim + '\n\n' -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set prefix = '' -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- for message in turns -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('Gemma conversations alternate user and assistant turns (after an optional system message); got ' + message['role'] + ' at turn ' + loop.index|string) }}
    {%- endif -%}
    {{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\n' }}
    {{- (prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""

_BY_ARCHITECTURE = {"gemma": GEMMA_TEMPLATE, "gemma2": GEMMA_TEMPLATE, "gemma3": GEMMA_TEMPLATE}


def default_chat_template(architecture: str) -> str | None:
    """The template for a file of this architecture that ships none (None: no default)."""
    return _BY_ARCHITECTURE.get(architecture)
