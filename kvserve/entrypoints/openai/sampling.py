"""From a request's fields to SamplingParams, and the engine's prompt checks, with
errors that name the request field."""
from __future__ import annotations

from typing import Any

from kvserve.entrypoints.openai.context import ServerContext
from kvserve.entrypoints.openai.errors import bad_request, from_value_error
from kvserve.sampling_params import SamplingParams
from kvserve.structured_output import StructuredOutputsParams

SAMPLING_FIELDS = frozenset(
    {"n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
     "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens",
     "min_tokens", "logprobs", "prompt", "messages", "logit_bias"})


def make_sampling_params(req: Any, max_tokens: int | None, logprobs: int | None,
                         tokenizer, defaults: dict[str, Any] | None = None) -> SamplingParams:
    """``defaults``: the model's recommended sampling fields, for those the request
    leaves unset (``max_tokens`` is the caller's to settle)."""
    defaults = defaults or {}
    kwargs = dict(n=req.n, stop=req.stop, seed=req.seed, stop_token_ids=req.stop_token_ids,
                  logit_bias=_token_biases(req.logit_bias), ignore_eos=req.ignore_eos,
                  bad_words_token_ids=_bad_word_sequences(req.bad_words, tokenizer),
                  structured_outputs=structured_outputs_of(req), max_tokens=max_tokens, min_tokens=req.min_tokens,
                  logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
                  include_stop_str_in_output=req.include_stop_str_in_output)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty"):
        if getattr(req, name) is not None:
            kwargs[name] = getattr(req, name)
        elif name in defaults:
            kwargs[name] = defaults[name]
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise from_value_error(e, SAMPLING_FIELDS) from None


def _token_biases(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids written as strings."""
    if not logit_bias:
        return None
    out = {}
    for key, bias in logit_bias.items():
        if not key.strip().isdigit():
            raise bad_request(f"logit_bias keys must be token ids, got {key!r:.40}",
                              "logit_bias")
        out[int(key)] = bias
    return out


def default_max_tokens(given: int | None, defaults: dict[str, Any], room: int) -> int | None:
    """The request's max_tokens, else the model's recommended one within the room the
    prompt leaves, else None."""
    if given is not None or "max_tokens" not in defaults:
        return given
    return max(1, min(int(defaults["max_tokens"]), room))


def structured_outputs_of(req: Any) -> StructuredOutputsParams | None:
    """The one output constraint a request carries, whichever field it came in."""
    forms = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            forms.append(("response_format", dict(json_object=True)))
        elif rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request("response_format json_schema needs json_schema.schema",
                              "response_format")
        else:
            forms.append(("response_format", dict(json=rf.json_schema.schema_)))
    so = req.structured_outputs
    if so is not None:
        given = {k: v for k, v in (("json", so.json_), ("regex", so.regex),
                                    ("choice", so.choice), ("grammar", so.grammar),
                                    ("json_object", so.json_object or None)) if v is not None}
        forms.append(("structured_outputs", given))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                      ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            forms.append((name, {key: getattr(req, name)}))
    if not forms:
        return None
    if len(forms) > 1:
        raise bad_request("give one output constraint, got "
                          f"{', '.join(f for f, _ in forms)}", forms[1][0])
    field, kwargs = forms[0]
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as e:
        raise bad_request(str(e), field) from None


def _bad_word_sequences(words: list[str] | None, tokenizer) -> list[list[int]] | None:
    """Each bad word as the model writes it alone and after a space (as vLLM)."""
    if not words:
        return None
    seqs = []
    for word in words:
        if not word.strip():
            raise bad_request("bad_words must be non-empty strings", "bad_words")
        for text in (word, " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in seqs:
                seqs.append(ids)
    return seqs


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the prompt's last ``keep`` tokens (-1: as many
    as the model takes)."""
    if keep is None:
        return ids
    if keep == 0:
        raise bad_request("truncate_prompt_tokens must be -1 or at least 1",
                          "truncate_prompt_tokens")
    keep = max_model_len if keep == -1 else keep
    return ids[-keep:]


def check_prompt(ctx: ServerContext, token_ids: list[int], params: SamplingParams) -> None:
    """The engine's own prompt checks, run before anything is queued."""
    try:
        ctx.engine.validate_prompt(token_ids, params)
    except ValueError as e:
        raise from_value_error(e, SAMPLING_FIELDS) from None
