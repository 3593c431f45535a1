"""The model's tokenizer (``tokenizers`` library) and chat template (jinja2)."""
from __future__ import annotations

import json
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Encode, decode, stream-decode and apply the chat template of one model directory."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"model directory {model_dir} has no tokenizer.json (kvserve reads fast "
                "tokenizers saved by the tokenizers/transformers libraries)")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.chat_template = self._read_chat_template(model_dir, cfg)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = {i for i, tok in self._tok.get_added_tokens_decoder().items()
                            if tok.special}

    @staticmethod
    def _read_chat_template(model_dir: Path, cfg: dict) -> str | None:
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text()
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"),
                            template[0]["template"] if template else None)
        return template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def decode_stream(self, prefix_ids: list[int], skip_special_tokens: bool = True
                      ) -> "StreamDecoder":
        return StreamDecoder(self._tok, prefix_ids, skip_special_tokens)

    def renders_tools(self, chat_template: str | None = None) -> bool:
        """Whether the chat template (the model's, or ``chat_template``) shows the model
        its tools."""
        template = chat_template or self.chat_template
        return bool(template) and "tools" in template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, *,
                            documents: list[dict] | None = None,
                            continue_final_message: bool = False,
                            template_kwargs: dict | None = None,
                            chat_template: str | None = None) -> str:
        """The conversation as the model's template writes it. ``documents``: passed to
        the template (retrieval-augmented templates); ``continue_final_message``: the
        text ends with the last message's content, left open for the model to continue
        (no generation prompt); ``template_kwargs``: more variables for the template
        (Qwen3's ``enable_thinking``), as transformers' ``apply_chat_template`` takes;
        ``chat_template``: a template to use instead of the model's."""
        extra = dict(template_kwargs or {})
        reserved = sorted(set(extra) & TEMPLATE_VARIABLES)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: the "
                             "request's own fields set them")
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError("continue_final_message and add_generation_prompt cannot "
                                 "both be true")
            if not messages or not isinstance(messages[-1].get("content"), str):
                raise ValueError("continue_final_message needs a last message with text "
                                 "content")
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this model has no chat template (tokenizer_config.json "
                             "'chat_template' or chat_template.jinja); use a completion prompt")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        env.filters["tojson"] = lambda value, indent=None: json.dumps(
            value, ensure_ascii=False, indent=indent)  # as transformers: no HTML escaping
        try:
            text = env.from_string(template).render(
                **extra, messages=messages, add_generation_prompt=add_generation_prompt,
                tools=tools, documents=documents, bos_token=self.bos_token or "",
                eos_token=self.eos_token or "")
        except TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from e
        if continue_final_message:  # cut what the template wrote after the last content
            final = messages[-1]["content"].strip()
            end = text.rfind(final)
            if not final or end < 0:
                raise ValueError("continue_final_message: the template does not write the "
                                 "last message's content as given")
            text = text[:end + len(final)]
        return text


def load_chat_template(value: str) -> str:
    """``--chat-template``: a Jinja file's path, or the template's text itself."""
    path = Path(value)
    if "{" not in value:
        if not path.is_file():
            raise ValueError(f"--chat-template {value!r}: no such file (give a Jinja "
                             "template file or the template's text)")
        value = path.read_text()
    try:
        ImmutableSandboxedEnvironment().parse(value)
    except TemplateError as e:
        raise ValueError(f"--chat-template is not a valid Jinja template: {e}") from None
    return value


# what the template's own arguments are: chat_template_kwargs may not shadow them
TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "documents",
                                "bos_token", "eos_token", "raise_exception"})


def _raise_template_error(message: str):
    raise TemplateError(message)


class StreamDecoder:
    """Incremental detokenization: text appears once its bytes form whole characters.

    Seeded with the prompt's last tokens so that decoders that strip or merge spaces
    at a sequence start see the same context as a full decode.
    """

    def __init__(self, tok: HFTokenizer, prefix_ids: list[int], skip_special_tokens: bool) -> None:
        self._tok = tok
        self._stream = DecodeStream(ids=list(prefix_ids[-6:]),
                                    skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tok, token_id) or ""
