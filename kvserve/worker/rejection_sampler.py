"""Verify draft tokens: the accepted prefix of each request's drafts, plus one token.

A request with drafts d_1..d_k gives k+1 rows of logits: row j is the target model's
distribution after the context and d_1..d_j. Each row is processed as the sampler
processes a single row (penalties and min_tokens see the drafts before it as output),
so p_j below is exactly the distribution the sampler would draw from at that point.

- Greedy: d_j is accepted while it is row j-1's argmax; the first row whose argmax
  differs gives the last token (all accepted: row k's argmax, the bonus token). The
  tokens are those plain greedy decoding gives.
- Sampled: row j's token is drawn from p_j as the sampler draws it (the exponential race
  on the request's generator: one noise vector a row), and d_j is accepted when the draw
  is d_j; the first draw that differs is the last token, and all accepted, row k's draw
  is the bonus token. This is rejection sampling (Leviathan et al. 2023; Chen et al.
  2023) with the drafts as a one-hot proposal: d_j is accepted with probability p(d_j),
  and a rejection's token has p without d_j, normalised. Each token has exactly the
  distribution plain sampling gives, and the rows after the last token draw nothing.

A request with a seed draws from its own generator, so its output does not depend on
its batch neighbours, and since each emitted token used one draw, as in plain decoding,
it is the token sequence plain sampling gives with the same seed.
"""
from __future__ import annotations

import torch

from kvserve.core.scheduler_output import SamplingInfo
from kvserve.worker.sampler import Sampler, SampleResult


def _row_infos(info: SamplingInfo, drafts: list[int]) -> list[SamplingInfo]:
    """One SamplingInfo per row: row j sees drafts[:j] as generated output."""
    out = list(info.output_token_ids)
    return [SamplingInfo(info.params, info.prompt_token_ids, out + drafts[:j],
                         info.eos_token_id) for j in range(len(drafts) + 1)]


class RejectionSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, request_ids: list[str],
                 infos: list[SamplingInfo], drafts: list[list[int]],
                 masks: list | None = None) -> list[list[SampleResult]]:
        """``logits``: each request's rows (len(drafts[i]) + 1 of them) one after the
        other, in request order; ``masks``: per request, its rows' allowed tokens or
        None. Returns each request's new tokens."""
        raw = logits.float()
        processed, rows = raw, None
        row_masks = None
        if masks is not None and any(m is not None for m in masks):
            row_masks = [None if m is None else m[j] for m, d in zip(masks, drafts)
                         for j in range(len(d) + 1)]
        if row_masks is not None or any(
                i.params.uses_penalties or i.params.logit_bias or i.params.bad_words_token_ids
                or i.params.min_tokens > len(i.output_token_ids) for i in infos):
            rows = [r for info, d in zip(infos, drafts) for r in _row_infos(info, d)]
            processed = self.sampler.process(raw, rows, row_masks)
        greedy_tokens = processed.argmax(dim=-1).tolist()
        emitted: list[list[int]] = []
        first = 0
        for rid, info, d in zip(request_ids, infos, drafts):
            span = slice(first, first + len(d) + 1)
            if info.params.greedy:
                emitted.append(self._verify_greedy(d, greedy_tokens[span]))
            else:
                row_infos = rows[span] if rows is not None else _row_infos(info, d)
                emitted.append(self._verify_sampled(processed[span], row_infos, d, rid))
            first += len(d) + 1
        return self._results(raw, infos, drafts, emitted, rows)

    def _results(self, raw: torch.Tensor, infos: list[SamplingInfo],
                 drafts: list[list[int]], emitted: list[list[int]],
                 rows: list[SamplingInfo] | None) -> list[list[SampleResult]]:
        """SampleResults of every emitted token (token j of a request from its row j),
        in one pass over the rows; logprobs where asked for."""
        if all(i.params.logprobs is None for i in infos):
            return [[SampleResult(t) for t in tokens] for tokens in emitted]
        index, tokens, row_infos, first = [], [], [], 0
        for info, d, out in zip(infos, drafts, emitted):
            index += range(first, first + len(out))
            tokens += out
            row_infos += [info] * len(out)
            first += len(d) + 1
        flat = self.sampler._results(raw[index], torch.tensor(tokens), row_infos)
        results, pos = [], 0
        for out in emitted:
            results.append(flat[pos:pos + len(out)])
            pos += len(out)
        return results

    @staticmethod
    def _verify_greedy(drafts: list[int], argmax: list[int]) -> list[int]:
        tokens = []
        for j, draft in enumerate(drafts):
            tokens.append(argmax[j])
            if argmax[j] != draft:
                return tokens
        return tokens + [argmax[len(drafts)]]

    def _verify_sampled(self, logits: torch.Tensor, rows: list[SamplingInfo],
                        drafts: list[int], request_id: str) -> list[int]:
        params = rows[0].params
        probs = self.sampler._filtered_probs(logits / params.temperature, rows)
        gen = (self.sampler._generator_for(request_id, params.seed)
               if params.seed is not None else self.sampler.generator)
        tokens = []
        for j in range(len(drafts) + 1):
            tokens.append(self._draw(probs[j], gen))
            if j == len(drafts) or tokens[-1] != drafts[j]:
                break
        return tokens

    @staticmethod
    def _draw(probs: torch.Tensor, gen: torch.Generator) -> int:
        """A token from (unnormalised) ``probs``: the exponential race, as the sampler."""
        noise = torch.empty_like(probs).exponential_(generator=gen)
        return int((probs / noise).argmax())
