"""Turn the last-position logits of a step into next tokens, vectorised over rows.

Order of processing (as vLLM): penalties -> min_tokens masking -> greedy argmax, or
temperature -> top-k -> top-p -> min-p -> a draw. Draws use the exponential race
(argmax of p / Exp(1)), which needs one random vector per row: rows with a ``seed``
take theirs from a per-request generator, so their samples do not depend on what
else is in the batch. Logprobs are of the raw model distribution (log-softmax of the
logits), like vLLM's default.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.core.scheduler_output import SamplingInfo


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None = None
    rank: int | None = None  # 1 = the most likely token
    top_logprobs: list[tuple[int, float]] | None = None  # (token, logprob), best first


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}

    def drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._request_generators.pop(rid, None)

    def __call__(self, logits: torch.Tensor, request_ids: list[str],
                 infos: list[SamplingInfo], masks: list | None = None) -> list[SampleResult]:
        """``masks``: per row, the allowed tokens (bool [vocab]) or None: unconstrained."""
        raw = logits if logits.dtype == torch.float32 else logits.float()
        logits = self.process(raw, infos, masks)
        greedy = [i.params.greedy for i in infos]
        if all(greedy):  # numpy's argmax (same ties: the first) costs less right after a step
            tokens = logits.numpy().argmax(axis=-1)
        else:
            tokens = self._draw(logits, request_ids, infos, greedy)
        return self._results(raw, tokens, infos)

    # -- logit processors ---------------------------------------------------------------

    @classmethod
    def process(cls, raw: torch.Tensor, infos: list[SamplingInfo], masks: list | None = None
                ) -> torch.Tensor:
        """The logits every draw and argmax uses: ``raw`` (float32) with each row's
        penalties, logit bias, bad words, min_tokens stop mask and grammar mask applied
        (a copy where any applies, ``raw`` itself otherwise). The one place rows are
        processed, for the sampler and the draft verifier alike."""
        logits = raw
        allowed = None
        if masks is not None and any(m is not None for m in masks):
            allowed = torch.ones(raw.shape, dtype=torch.bool)
            for row, mask in enumerate(masks):
                if mask is not None:
                    allowed[row] = mask
            logits = raw.masked_fill(~allowed, float("-inf"))
        logits = cls._process_unmasked(raw, logits, infos)
        if allowed is not None:  # the grammar wins where the rest would leave no token
            dead = torch.isneginf(logits).all(dim=-1)
            if bool(dead.any()):
                logits[dead] = raw[dead].masked_fill(~allowed[dead], float("-inf"))
        return logits

    @classmethod
    def _process_unmasked(cls, raw: torch.Tensor, logits: torch.Tensor,
                          infos: list[SamplingInfo]) -> torch.Tensor:
        if any(i.params.uses_penalties for i in infos):
            logits = cls._apply_penalties(logits.clone(), infos)
        if any(i.params.logit_bias for i in infos):
            logits = cls._apply_logit_bias(logits if logits is not raw else raw.clone(), infos)
        if any(i.params.bad_words_token_ids for i in infos):
            logits = cls._ban_bad_words(logits if logits is not raw else raw.clone(), infos)
        if any(i.params.min_tokens > len(i.output_token_ids) for i in infos):
            logits = cls._mask_early_stops(logits if logits is not raw else raw.clone(), infos)
        return logits

    @staticmethod
    def _ban_bad_words(logits: torch.Tensor, infos: list[SamplingInfo]) -> torch.Tensor:
        for row, info in enumerate(infos):
            out = info.output_token_ids
            for seq in info.params.bad_words_token_ids or ():
                *head, last = seq
                if not head or (len(out) >= len(head) and list(out[-len(head):]) == head):
                    logits[row, last] = float("-inf")
        return logits

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, infos: list[SamplingInfo]) -> torch.Tensor:
        for row, info in enumerate(infos):
            bias = info.params.logit_bias
            if bias:
                ids = torch.tensor(list(bias), dtype=torch.long)
                logits[row, ids] += torch.tensor(list(bias.values()), dtype=logits.dtype)
        return logits

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, infos: list[SamplingInfo]) -> torch.Tensor:
        vocab = logits.shape[-1]
        for row, info in enumerate(infos):
            p = info.params
            if not p.uses_penalties:
                continue
            out = torch.tensor(list(info.output_token_ids), dtype=torch.long)
            counts = torch.bincount(out, minlength=vocab)[:vocab].float()
            if p.repetition_penalty != 1.0:
                seen = counts > 0
                seen[torch.tensor(list(info.prompt_token_ids), dtype=torch.long)] = True
                row_logits = logits[row]
                penalised = torch.where(row_logits > 0, row_logits / p.repetition_penalty,
                                        row_logits * p.repetition_penalty)
                logits[row] = torch.where(seen, penalised, row_logits)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        return logits

    @staticmethod
    def _mask_early_stops(logits: torch.Tensor, infos: list[SamplingInfo]) -> torch.Tensor:
        for row, info in enumerate(infos):
            if info.params.min_tokens > len(info.output_token_ids):
                stops = list(info.params.stop_token_ids)
                if info.eos_token_id is not None:
                    stops.append(info.eos_token_id)
                if stops:
                    logits[row, stops] = float("-inf")
        return logits

    def _draw(self, logits: torch.Tensor, request_ids: list[str], infos: list[SamplingInfo],
              greedy: list[bool]) -> torch.Tensor:
        temps = torch.tensor([1.0 if g else i.params.temperature for g, i in zip(greedy, infos)])
        probs = self._filtered_probs(logits / temps[:, None], infos)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, (rid, info) in enumerate(zip(request_ids, infos)):
            if info.params.seed is not None and not greedy[row]:
                noise[row].exponential_(generator=self._generator_for(rid, info.params.seed))
        sampled = (probs / noise).argmax(dim=-1)
        greedy_mask = torch.tensor(greedy)
        return torch.where(greedy_mask, logits.argmax(dim=-1), sampled)

    def _generator_for(self, request_id: str, seed: int) -> torch.Generator:
        gen = self._request_generators.get(request_id)
        if gen is None:
            gen = self._request_generators[request_id] = torch.Generator().manual_seed(seed)
        return gen

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, infos: list[SamplingInfo]) -> torch.Tensor:
        vocab = logits.shape[-1]
        if all(not i.params.top_k and i.params.top_p >= 1.0 and not i.params.min_p
               for i in infos):  # nothing to filter: no sort over the vocabulary
            return logits.softmax(dim=-1)
        top_k = torch.tensor([i.params.top_k or vocab for i in infos])
        top_p = torch.tensor([i.params.top_p for i in infos])
        min_p = torch.tensor([i.params.min_p for i in infos])
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab)[None, :]
        remove = ranks >= top_k[:, None]
        sorted_probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
        remove |= before > top_p[:, None]
        remove |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]
        remove[:, 0] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        filtered = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
        return filtered.softmax(dim=-1)

    @staticmethod
    def _results(raw: torch.Tensor, tokens, infos: list[SamplingInfo]) -> list[SampleResult]:
        """``tokens``: the rows' tokens, a torch or numpy vector."""
        token_list = tokens.tolist()
        want = [i.params.logprobs for i in infos]
        if all(w is None for w in want):
            return [SampleResult(t) for t in token_list]
        logprobs = raw.log_softmax(dim=-1)
        k = max(w or 0 for w in want)
        top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
        results = []
        for row, (t, w) in enumerate(zip(token_list, want)):
            if w is None:
                results.append(SampleResult(t))
                continue
            top = [] if not w else list(zip(top_ids[row, :w].tolist(), top_vals[row, :w].tolist()))
            chosen = logprobs[row, t]
            rank = int((logprobs[row] > chosen).sum()) + 1
            results.append(SampleResult(t, float(chosen), rank, top))
        return results
