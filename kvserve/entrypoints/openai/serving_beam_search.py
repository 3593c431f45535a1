"""Beam search in /v1/completions (vLLM's ``use_beam_search``): each round's beams go to
the engine as requests beside everyone else's (engine/beam_search.py); ``n`` hypotheses
come back of ``best_of`` (default ``n``) beams, best first."""
from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from kvserve.engine.beam_search import BeamSearchParams, round_params, search_rounds
from kvserve.entrypoints.openai.context import ServerContext, random_id
from kvserve.entrypoints.openai.errors import bad_request
from kvserve.entrypoints.openai.protocol import (CompletionChoice, CompletionRequest,
                                                 CompletionResponse, UsageInfo)
from kvserve.entrypoints.openai.streaming import add_all, finished_outputs


def beam_params(req: CompletionRequest, max_tokens: int) -> BeamSearchParams:
    """The request's beam search, checked; 400s name the field."""
    for name in ("stream", "echo", "logprobs", "prompt_logprobs"):
        if getattr(req, name):
            raise bad_request(f"{name} is not available with use_beam_search", name)
    if req.temperature not in (None, 0):
        raise bad_request("beam search keeps the most likely beams: temperature must be 0 "
                          "or unset", "temperature")
    width = req.best_of or req.n
    if req.n > width:
        raise bad_request(f"n ({req.n}) cannot exceed best_of ({width}), the beam width",
                          "best_of")
    try:
        return BeamSearchParams(width, max_tokens, ignore_eos=req.ignore_eos,
                                length_penalty=req.length_penalty,
                                early_stopping=req.early_stopping)
    except ValueError as e:
        raise bad_request(str(e), "best_of" if "beam_width" in str(e) else None) from None


async def beam_search_completion(request: Request, ctx: ServerContext,
                                 req: CompletionRequest, prompts: list[list[int]],
                                 params: BeamSearchParams) -> Response:
    engine = ctx.engine.engine
    rounds = search_rounds(prompts, params, engine.stop_ids, engine.tokenizer.decode)
    step, request_id, arrival = round_params(params), random_id("cmpl"), time.monotonic()
    try:
        batch, number = next(rounds), 0
        while True:
            ctx.check_capacity(len(batch))
            streams = await add_all(ctx, f"{request_id}-{number}", batch,
                                    [step] * len(batch), req.priority, arrival,
                                    final_only=True)
            batch, number = rounds.send(await finished_outputs(request, ctx, streams)), \
                number + 1
    except StopIteration as done:
        results = done.value
    choices, generated = [], 0
    for i, result in enumerate(results):
        for j, seq in enumerate(result.sequences[:req.n]):
            tokens = seq.tokens
            if seq.finish_reason == "stop" and not req.include_stop_str_in_output:
                tokens = tokens[:-1]  # the EOS is not text
            choices.append(CompletionChoice(index=i * req.n + j,
                                            text=engine.tokenizer.decode(tokens),
                                            finish_reason=seq.finish_reason))
            generated += len(seq.tokens)
    prompt_tokens = sum(len(p) for p in prompts)
    body = CompletionResponse(id=request_id, model=ctx.model_name, choices=choices,
                              usage=UsageInfo(prompt_tokens=prompt_tokens,
                                              completion_tokens=generated,
                                              total_tokens=prompt_tokens + generated))
    return Response(body.model_dump_json(), media_type="application/json")
