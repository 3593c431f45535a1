"""The chat template's extra inputs, rendered as transformers renders them: template
variables (Qwen3's enable_thinking), documents, continue_final_message; and the server's
chat fields that carry them, with errors that name the field."""
from __future__ import annotations

import json
import shutil

import pytest

from kvserve.model.tokenizer import Tokenizer

TEMPLATE = (
    "{% if documents %}<|system|>\n{% for d in documents %}[{{ d['title'] }}] {{ d['text'] }}\n"
    "{% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>\n{% endif %}"
    "{% endif %}")

MESSAGES = [{"role": "user", "content": "Reverse a string."},
            {"role": "assistant", "content": "def rev(s):"}]


@pytest.fixture(scope="module")
def model_dir(llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("templated") / "m"
    shutil.copytree(llama_dir, out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return str(out)


@pytest.mark.parametrize("kwargs", [
    {"add_generation_prompt": True},
    {"add_generation_prompt": True, "enable_thinking": False},
    {"add_generation_prompt": True, "documents": [{"title": "a", "text": "one"},
                                                  {"title": "b", "text": "two"}]},
    {"add_generation_prompt": False, "continue_final_message": True},
], ids=["plain", "template-kwargs", "documents", "continue"])
def test_rendered_as_transformers_renders(model_dir, kwargs):
    from transformers import AutoTokenizer
    want = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        MESSAGES, tokenize=False, **kwargs)
    extra = {k: v for k, v in kwargs.items() if k not in (
        "add_generation_prompt", "documents", "continue_final_message")}
    got = Tokenizer(model_dir).apply_chat_template(
        MESSAGES, kwargs["add_generation_prompt"], documents=kwargs.get("documents"),
        continue_final_message=kwargs.get("continue_final_message", False),
        template_kwargs=extra)
    assert got == want


def test_bad_combinations_are_named(model_dir):
    tok = Tokenizer(model_dir)
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        tok.apply_chat_template(MESSAGES, True, continue_final_message=True)
    with pytest.raises(ValueError, match="chat_template_kwargs may not set messages"):
        tok.apply_chat_template(MESSAGES, True, template_kwargs={"messages": []})
    with pytest.raises(ValueError, match="may not set raise_exception"):
        tok.apply_chat_template(MESSAGES, True, template_kwargs={"raise_exception": 1})


def test_llm_chat_continues_the_final_message(model_dir):
    from kvserve import LLM, SamplingParams
    llm = LLM(model_dir)
    out = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=3),
                   add_generation_prompt=False, continue_final_message=True,
                   use_tqdm=False)[0]
    assert out.prompt.endswith("def rev(s):")
    thinking = llm.chat(MESSAGES[:1], SamplingParams(max_tokens=1), use_tqdm=False,
                        chat_template_kwargs={"enable_thinking": False})[0]
    assert thinking.prompt.endswith("<|assistant|>\n<think></think>\n")


def test_a_chat_template_given_as_a_file_or_text_replaces_the_models(tmp_path, tokenizer_dir):
    from kvserve.model.tokenizer import Tokenizer, load_chat_template

    tok = Tokenizer(tokenizer_dir)
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    for given in (str(path), path.read_text()):
        template = load_chat_template(given)
        text = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                       chat_template=template)
        assert text == "[hi]"
    assert not tok.renders_tools() and tok.renders_tools("{{ tools }}")
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        load_chat_template("{% for m in messages %}")
