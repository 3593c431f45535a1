"""From a request's fields to SamplingParams, and the engine's prompt checks, with
errors that name the request field."""
from __future__ import annotations

from typing import Any

from kvserve.entrypoints.openai.context import ServerContext
from kvserve.entrypoints.openai.errors import bad_request, from_value_error
from kvserve.sampling_params import SamplingParams

SAMPLING_FIELDS = frozenset(
    {"n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
     "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens",
     "min_tokens", "logprobs", "prompt", "messages", "logit_bias"})


def make_sampling_params(req: Any, max_tokens: int | None, logprobs: int | None
                         ) -> SamplingParams:
    kwargs = dict(n=req.n, stop=req.stop, seed=req.seed, stop_token_ids=req.stop_token_ids,
                  logit_bias=_token_biases(req.logit_bias), ignore_eos=req.ignore_eos, max_tokens=max_tokens, min_tokens=req.min_tokens,
                  logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
                  include_stop_str_in_output=req.include_stop_str_in_output)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty"):
        if getattr(req, name) is not None:
            kwargs[name] = getattr(req, name)
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


def check_prompt(ctx: ServerContext, token_ids: list[int], params: SamplingParams) -> None:
    """The engine's own prompt checks, run before anything is queued."""
    try:
        ctx.engine.validate_prompt(token_ids, params)
    except ValueError as e:
        raise from_value_error(e, SAMPLING_FIELDS) from None
