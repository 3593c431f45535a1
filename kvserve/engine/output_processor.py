"""From sampled tokens to RequestOutputs: detokenize, find stop strings, group n samples.

A request with ``n > 1`` runs as n child sequences in the scheduler; this module keeps
their text and logprobs and reports them together under the parent's id.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.model.tokenizer import StreamDecoder, Tokenizer
from kvserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvserve.request import Request
from kvserve.worker.sampler import SampleResult


@dataclass
class SequenceState:
    """Output-side state of one child sequence."""

    index: int
    decoder: StreamDecoder
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    stop_string: str | None = None


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: dict[str, SequenceState] = field(default_factory=dict)
    requests: dict[str, Request] = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    pooled: list[float] | None = None  # an embedding request's vector


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.parent_of: dict[str, str] = {}

    def add(self, parent_id: str, prompt: str | None, children: list[Request]) -> None:
        state = ParentState(parent_id, prompt, children[0].prompt_token_ids)
        if children[0].sampling_params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(state.prompt_token_ids)
        for index, req in enumerate(children):
            sp = req.sampling_params
            seq = SequenceState(index, self.tokenizer.decode_stream(
                req.prompt_token_ids, sp.skip_special_tokens))
            if sp.logprobs is not None:
                seq.logprobs, seq.cumulative_logprob = [], 0.0
            state.children[req.request_id] = seq
            state.requests[req.request_id] = req
            self.parent_of[req.request_id] = parent_id
        self.parents[parent_id] = state

    def child_ids(self, parent_id: str) -> list[str]:
        state = self.parents.get(parent_id)
        return list(state.children) if state else []

    def add_prompt_logprobs(self, scored: dict[str, tuple[int, list[SampleResult]]]) -> None:
        """Prompt tokens' logprobs from a step, by position (n samples and recomputed
        chunks score the same tokens again: the same values)."""
        for rid, (position, results) in scored.items():
            parent = self.parent_of.get(rid)
            entries = self.parents[parent].prompt_logprobs if parent is not None else None
            if entries is None:
                continue
            for i, result in enumerate(results):
                entries[position + i] = self._logprob_entry(result)

    def add_pooled(self, pooled: dict) -> None:
        for rid, vector in pooled.items():
            parent = self.parent_of.get(rid)
            if parent is not None:
                self.parents[parent].pooled = vector.tolist()

    def process_tokens(self, progressed: list[tuple[Request, int]],
                       results: dict[str, list[SampleResult]]) -> dict[str, tuple[str, int]]:
        """Detokenize the tokens each request kept this step (the first ``n`` of its
        results); returns, for each sequence whose text hit a stop string, (the string,
        how many of its kept tokens came after the one completing it)."""
        stopped = {}
        for req, kept in progressed:
            rid = req.request_id
            parent = self.parent_of.get(rid)
            if parent is None:  # not a request of ours (gone meanwhile)
                continue
            seq = self.parents[parent].children[rid]
            step_results = results.get(rid, [])[:kept]
            for i, result in enumerate(step_results):
                if seq.logprobs is not None:
                    seq.logprobs.append(self._logprob_entry(result))
                    seq.cumulative_logprob += result.logprob
                delta = seq.decoder.step(result.token_id)
                if not delta:
                    continue
                stop = self._append_checking_stops(seq, req, delta)
                if stop is not None:
                    stopped[rid] = (stop, len(step_results) - i - 1)
                    break
        return stopped

    def _append_checking_stops(self, seq: SequenceState, req: Request, delta: str
                               ) -> str | None:
        sp = req.sampling_params
        if not sp.stop_list:
            seq.text += delta
            return None
        tail_from = max(0, len(seq.text) - max(len(s) for s in sp.stop_list) + 1)
        seq.text += delta
        hits = [(seq.text.find(s, tail_from), s) for s in sp.stop_list]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return None
        pos, stop = min(hits)
        seq.text = seq.text[:pos + len(stop)] if sp.include_stop_str_in_output else seq.text[:pos]
        seq.stop_string = stop
        return stop

    def _logprob_entry(self, r: SampleResult) -> dict[int, Logprob]:
        entry = {tid: Logprob(lp, rank + 1, self.tokenizer.id_to_token(tid))
                 for rank, (tid, lp) in enumerate(r.top_logprobs or [])}
        if r.token_id not in entry:
            entry[r.token_id] = Logprob(r.logprob, r.rank, self.tokenizer.id_to_token(r.token_id))
        return entry

    def make_output(self, parent_id: str) -> RequestOutput:
        state = self.parents[parent_id]
        outputs = []
        for rid, seq in state.children.items():
            req = state.requests[rid]
            outputs.append(CompletionOutput(
                index=seq.index, text=seq.text, token_ids=list(req.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob, logprobs=seq.logprobs,
                finish_reason=req.finish_reason, stop_reason=req.stop_reason))
        first = next(iter(state.requests.values()))
        finished = all(o.finish_reason is not None for o in outputs)
        metrics = RequestMetrics(
            arrival_time=first.arrival_time,
            first_scheduled_time=min((r.first_scheduled_time for r in state.requests.values()
                                      if r.first_scheduled_time), default=None),
            first_token_time=min((r.first_token_time for r in state.requests.values()
                                  if r.first_token_time), default=None),
            finished_time=max((r.finished_time or 0 for r in state.requests.values()),
                              default=None) if finished else None)
        out = RequestOutput(
            request_id=parent_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            outputs=outputs, finished=finished, metrics=metrics,
            num_cached_tokens=first.num_cached_tokens, prompt_logprobs=state.prompt_logprobs,
            pooled=state.pooled)
        if finished:
            self.remove(parent_id)
        return out

    def remove(self, parent_id: str) -> None:
        state = self.parents.pop(parent_id, None)
        for rid in state.children if state else ():
            self.parent_of.pop(rid, None)
