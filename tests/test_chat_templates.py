"""Chat templates as models ship them: what transformers gives a template (break/continue, tojson's
arguments, the {% generation %} tag) renders in inferd's sandbox, and an HF directory's template
and BOS rule are read where newer checkpoints keep them (chat_template.jinja, the tokenizer.json
post-processor)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from inferd.loader import ChatTemplateError, load_model
from inferd.loader.tokenizer import _compile_template


def test_transformers_template_extras_render() -> None:
    source = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% generation %}{{ m | tojson(ensure_ascii=True, sort_keys=True) }}{% endgeneration %}"
        "{{ '|' }}{{ m.content | tojson(indent=2) }};{% endfor %}"
    )
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "é"},
                {"role": "assistant", "content": "never"}]  # fmt: skip
    text = _compile_template(source).render(messages=messages)
    assert text == '{"content": "\\u00e9", "role": "user"}|"é";'


def test_template_errors_say_what_went_wrong() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        _compile_template("{% for m in messages %}")
    refuse = _compile_template("{{ raise_exception('Only user turns here') }}")
    with pytest.raises(ChatTemplateError, match="refuses these messages: Only user turns here"):
        refuse.render(messages=[])


def test_hf_directory_template_file_and_post_processor_bos(tiny_models, tmp_path: Path) -> None:
    """transformers >= 4.43 saves the template as chat_template.jinja, and Llama 3 adds BOS in
    tokenizer.json's post-processor with no add_bos_token in tokenizer_config.json."""
    src = tiny_models["llama-hf"]
    directory = tmp_path / "model"
    shutil.copytree(src.path, directory)
    config_path = directory / "tokenizer_config.json"
    tcfg = json.loads(config_path.read_text())
    template = tcfg.pop("chat_template")
    del tcfg["add_bos_token"]
    config_path.write_text(json.dumps(tcfg))
    (directory / "chat_template.jinja").write_text(template)
    tok = HFTokenizer.from_file(str(directory / "tokenizer.json"))
    bos = tok.token_to_id(tcfg["bos_token"])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{tcfg['bos_token']} $A", special_tokens=[(tcfg["bos_token"], bos)]
    )
    tok.save(str(directory / "tokenizer.json"))

    loaded = load_model(directory, verbose=False).tokenizer
    assert loaded.chat_template == template
    assert loaded.add_bos_token and loaded.encode("hello")[0] == bos
    assert loaded.encode("hello")[1:] == src.tokenizer.encode("hello").ids  # one BOS only
    # Without the post-processor (and no flag) no BOS is added, as before.
    tok.post_processor = None
    tok.save(str(directory / "tokenizer.json"))
    assert load_model(directory, verbose=False).tokenizer.encode("hello")[0] != bos
