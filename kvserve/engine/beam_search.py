"""Beam search over the engine, as transformers' ``generate(num_beams=k)`` defines it.

Each round every live beam is one engine request for one token with the top ``2k``
logprobs of its next-token distribution (``2k`` per beam covers the best ``2k``
continuations of all beams together). The beams share their prompt and common prefix
through the prefix cache, and take their places in the scheduler like any request, so
they count against ``max_num_seqs`` and may be preempted. The selection follows
transformers': the best ``2k`` continuations; the best ``k`` that do not stop go on; a
continuation that stops (EOS, or the length limit) among the best ``k`` is finished
with its sum of logprobs over ``generated_length ** length_penalty``; ``k`` finished
hypotheses are kept; the search ends once no running beam can beat the worst of a full
set of finished ones (``early_stopping``: False, True or "never"), or nothing can go on.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.sampling_params import MAX_LOGPROBS, SamplingParams

DROPPED = -1.0e9  # transformers' score for a beam or hypothesis that does not count


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's names: ``beam_width`` beams, at most ``max_tokens`` new tokens."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as transformers'

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise ValueError(f"beam_width must be in [1, {MAX_LOGPROBS // 2}], got "
                             f"{self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError("early_stopping must be true, false or 'never', got "
                             f"{self.early_stopping!r}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]          # the generated tokens (an EOS that ended it included)
    cum_logprob: float         # their summed logprobs
    score: float               # cum_logprob / len(tokens) ** length_penalty
    text: str = ""
    finish_reason: str = "length"


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` hypotheses of a prompt, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass
class _Beam:
    tokens: list[int]
    score: float  # summed logprobs; DROPPED for a slot that holds no beam


class _Search:
    """One prompt's search state."""

    def __init__(self, prompt: list[int], params: BeamSearchParams, eos: set[int]) -> None:
        self.prompt, self.params, self.eos = prompt, params, eos
        k = params.beam_width
        self.width = max(2, 1 + len(eos)) * k  # continuations considered a round
        self.running = [_Beam([], 0.0)] + [_Beam([], DROPPED) for _ in range(k - 1)]
        self.finished: list[tuple[float, _Beam | None]] = [(DROPPED, None)] * k
        self.improvable = True
        self.done = False

    def live(self) -> list[_Beam]:
        return [b for b in self.running if b.score > DROPPED / 2]

    def advance(self, beams: list[_Beam], tops: list[dict[int, float]]) -> None:
        """One round: ``tops[i]``, the top logprobs of ``beams[i]``'s next token."""
        p, k = self.params, self.params.beam_width
        generated = len(beams[0].tokens) + 1  # the length every continuation has
        candidates = sorted(((b.score + lp, i, tok) for i, b in enumerate(beams)
                             for tok, lp in tops[i].items()),
                            key=lambda c: -c[0])[:self.width]
        stops = [(tok in self.eos and not p.ignore_eos) or generated >= p.max_tokens
                 for _, _, tok in candidates]
        going = sorted(((score + (DROPPED if stop else 0.0), beams[i].tokens + [tok])
                        for (score, i, tok), stop in zip(candidates, stops)),
                       key=lambda c: -c[0])[:k]
        self.running = [_Beam(tokens, score) for score, tokens in going]
        self.running += [_Beam([], DROPPED)] * (k - len(self.running))
        full = all(h is not None for _, h in self.finished) and p.early_stopping is True
        for (score, i, tok), stop in list(zip(candidates, stops))[:k]:
            if stop and not full and self.improvable:
                normalised = score / generated ** p.length_penalty
                self.finished.append((normalised, _Beam(beams[i].tokens + [tok], score)))
        self.finished = sorted(self.finished, key=lambda f: -f[0])[:k]
        best_length = (p.max_tokens if p.early_stopping == "never" and p.length_penalty > 0
                       else generated)
        best_possible = self.running[0].score / best_length ** p.length_penalty
        all_finished = all(h is not None for _, h in self.finished)
        worst = min(s for s, _ in self.finished) if all_finished else DROPPED
        self.improvable = self.improvable and best_possible > worst
        self.done = (not self.improvable or (all_finished and p.early_stopping is True)
                     or all(stops))

    def result(self, decode) -> BeamSearchOutput:
        out = BeamSearchOutput()
        for score, beam in self.finished:
            if beam is None:
                continue
            stopped = beam.tokens[-1] in self.eos and not self.params.ignore_eos
            out.sequences.append(BeamSearchSequence(
                beam.tokens, beam.score, score, decode(beam.tokens),
                "stop" if stopped else "length"))
        return out


def round_params(params: BeamSearchParams) -> SamplingParams:
    """What each beam asks the engine for a round: one token, its top ``2k`` logprobs."""
    return SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * params.beam_width,
                          ignore_eos=True)


def search_rounds(prompts: list[list[int]], params: BeamSearchParams, eos: set[int],
                  decode):
    """Every prompt's search, all their live beams in one batch a round: a generator
    that yields a round's prompts and is sent their outputs (whoever runs the engine,
    offline or the server); it returns the results."""
    searches = [_Search(p, params, eos) for p in prompts]
    while True:
        work = [(s, s.live()) for s in searches if not s.done]
        if not work:
            return [s.result(decode) for s in searches]
        outs = iter((yield [{"prompt_token_ids": s.prompt + b.tokens}
                            for s, beams in work for b in beams]))
        for s, beams in work:
            tops = []
            for _ in beams:
                entry = next(outs).outputs[0].logprobs[0]
                tops.append({tok: lp.logprob for tok, lp in entry.items()})
            s.advance(beams, tops)


def beam_search(llm, prompts: list[list[int]], params: BeamSearchParams,
                eos: set[int]) -> list[BeamSearchOutput]:
    rounds = search_rounds(prompts, params, eos, llm.get_tokenizer().decode)
    step = round_params(params)
    try:
        batch = next(rounds)
        while True:
            batch = rounds.send(llm.generate(batch, step, use_tqdm=False))
    except StopIteration as done:
        return done.value
