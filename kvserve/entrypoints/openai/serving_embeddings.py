"""POST /v1/embeddings: each input's prompt pooled into one vector by the same engine and
scheduler that generate (``--runner auto`` or ``pooling``); float lists, or base64 of
little-endian float32 as OpenAI's client decodes them."""
from __future__ import annotations

import base64
import struct
import time

from starlette.requests import Request
from starlette.responses import Response

from kvserve.entrypoints.openai.context import ServerContext, random_id
from kvserve.entrypoints.openai.errors import bad_request
from kvserve.entrypoints.openai.protocol import (EmbeddingData, EmbeddingRequest,
                                                 EmbeddingResponse, EmbeddingUsage)
from kvserve.entrypoints.openai.request_body import parse_request
from kvserve.entrypoints.openai.serving_completions import tokenize_prompts
from kvserve.entrypoints.openai.streaming import finished_outputs
from kvserve.pooling_params import PoolingParams


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


async def create_embedding(request: Request, ctx: ServerContext) -> Response:
    arrival = time.monotonic()
    req = await parse_request(request, EmbeddingRequest, ctx.max_body_bytes)
    ctx = ctx.for_model(req.model)
    prompts = await tokenize_prompts(ctx, req.input, "input")
    params = PoolingParams(dimensions=req.dimensions)
    ctx.check_capacity(len(prompts))
    request_id = random_id("embd")
    streams = []
    try:
        for i, (text, ids) in enumerate(prompts):
            prompt = {"prompt_token_ids": ids, **({"prompt": text} if text else {})}
            streams.append(await ctx.engine.add_request(
                f"{request_id}-{i}", prompt, params, arrival_time=arrival, final_only=True,
                lora_request=ctx.lora))
    except ValueError as e:
        ctx.engine.abort([s.request_id for s in streams])
        param = "dimensions" if "dimensions" in str(e) else "input"
        raise bad_request(str(e), param) from None
    finals = await finished_outputs(request, ctx, streams)
    data = [EmbeddingData(index=i, embedding=_encode(out.pooled, req.encoding_format))
            for i, out in enumerate(finals)]
    tokens = sum(len(out.prompt_token_ids) for out in finals)
    body = EmbeddingResponse(data=data, model=ctx.model_name,
                             usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
    return Response(body.model_dump_json(), media_type="application/json")
