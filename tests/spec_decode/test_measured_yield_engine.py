"""Never a slowdown in the engine: on the tiny model, with start-up costs that say drafts
are nearly free (every step priced at 1 s whatever its rows), drafts that do not pay
stop being made after a few steps, drafts that do keep being made, and the greedy tokens
are those of plain decoding either way. These check what the steps carried, not the
wall clock, so a busy machine does not decide them."""
from __future__ import annotations

import time

import pytest

from kvserve import LLM, SamplingParams
from kvserve.request import Request
from kvserve.spec_decode import PROPOSERS
from kvserve.spec_decode.proposer import Proposer
from tests.helpers import VOCAB, prompts_of_lengths

MAX_NEW = 64
WARM_UP_STEPS = 40


class _KnowsTheOutput(Proposer):
    """Drafts from the plain greedy output of each prompt (set by the test), shifted
    by ``shift`` positions of the vocabulary: 0 is always right, 1 always wrong."""

    outputs: dict[tuple[int, ...], list[int]] = {}
    shift = 1
    sleep_s = 0.0  # the proposer's own time per call
    right_every = 0  # > 0: every right_every-th draft position right, the others wrong

    def propose(self, requests: list[Request], limits: dict[str, int]) -> dict[str, list[int]]:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        drafts = {}
        for req in requests:
            k = limits.get(req.request_id, 0)
            known = self.outputs.get(tuple(req.prompt_token_ids))
            if not k or known is None:
                continue
            done = req.num_output_tokens
            drafts[req.request_id] = [
                t if self.right_every and (done + j) % self.right_every == 0
                else (t + self.shift) % VOCAB
                for j, t in enumerate(known[done:done + k])]
        return drafts


@pytest.fixture(autouse=True)
def dear_steps_at_start(monkeypatch):
    """Start-up measures every step at 1 s, whatever its rows: by that measure, rows and
    proposing cost next to nothing, and only measuring steps as they run tells."""
    from kvserve.worker.cpu_worker import CPUWorker
    monkeypatch.setattr(CPUWorker, "time_step_rows",
                        lambda self, rows: {r: 1.0 * (1 + r / 1000) for r in rows})


@pytest.fixture(scope="module")
def prompts():
    return prompts_of_lengths([12, 30, 7], seed=11)


@pytest.fixture(scope="module")
def plain(llama_dir, prompts):
    llm = LLM(llama_dir, max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


@pytest.fixture
def proposer(prompts, plain):
    _KnowsTheOutput.outputs = {tuple(p): o for p, o in zip(prompts, plain)}
    PROPOSERS.register("knows", _KnowsTheOutput)
    yield _KnowsTheOutput
    PROPOSERS.unregister("knows")
    _KnowsTheOutput.shift, _KnowsTheOutput.sleep_s, _KnowsTheOutput.right_every = 1, 0.0, 0


def _run_one_at_a_time(llama_dir, prompts):
    """The greedy outputs, and per step whether it carried drafts (one request at a
    time, so a step carries drafts or not)."""
    llm = LLM(llama_dir, max_num_seqs=1,
              speculative_config={"method": "knows", "num_speculative_tokens": 4})
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    outputs, drafted = {}, []
    while engine.has_unfinished_requests():
        before = engine.speculator.stats.num_drafts
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        drafted.append(engine.speculator.stats.num_drafts > before)
    return [outputs[str(i)] for i in range(len(prompts))], drafted


def _pattern(drafted: list[bool]) -> str:
    """The steps, D for one that carried drafts, . for one that did not."""
    return "".join(".D"[d] for d in drafted)


def test_drafts_that_are_always_wrong_stop_after_a_warm_up(llama_dir, prompts, plain,
                                                            proposer):
    outputs, drafted = _run_one_at_a_time(llama_dir, prompts)
    assert outputs == plain
    later = drafted[WARM_UP_STEPS:]
    assert len(later) > 100 and sum(later) <= 0.1 * len(later), _pattern(drafted)


def test_drafts_that_cost_more_than_they_yield_stop(llama_dir, prompts, plain, proposer):
    """Every second draft position right, but proposing takes 50 ms a step, far more
    than the steps it saves (a step of the tiny model is a few ms)."""
    proposer.sleep_s, proposer.right_every = 0.05, 2
    outputs, drafted = _run_one_at_a_time(llama_dir, prompts)
    assert outputs == plain
    later = drafted[WARM_UP_STEPS:]
    assert sum(later) <= 0.1 * len(later), _pattern(drafted)


def test_drafts_that_pay_keep_being_made(llama_dir, prompts, plain, proposer):
    """Always right, proposed for free: each step gives five tokens for about the time of
    one, and nearly every step after the first few carries drafts."""
    proposer.shift = 0
    outputs, drafted = _run_one_at_a_time(llama_dir, prompts)
    assert outputs == plain
    decode_steps = drafted[3:]
    assert sum(decode_steps) >= 0.7 * len(decode_steps), _pattern(drafted)


def test_prompt_lookup_drafts_once_the_embedded_models_output_repeats():
    """The embedded model continuing code it was shown: its first tokens do not repeat
    what came before, and drafting them does not pay; then its greedy output loops
    ("name, name, ..."), and prompt lookup's drafts are accepted. Drafting resumes at a
    trial (640 tokens leave room for one after the longest wait), then carries a good
    share of the steps: not all, since a step verifying two drafts costs up to two or
    three plain steps of this model, so on a machine whose other load comes and goes
    drafting is at times measured not to pay, and stops until the next trial. The
    tokens are plain decoding's."""
    code = ("def add_numbers(first, second):\n    total = first + second\n"
            "    return total\n\n\ndef subtract_numbers(first, second):\n"
            "    difference = first - second\n    return difference\n\n\n")
    prompt = code + code + "def add_numbers("
    params = SamplingParams(temperature=0.0, max_tokens=640, ignore_eos=True)
    plain = LLM().generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    engine = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4},
                 max_num_seqs=1).engine
    engine.add_request("code", prompt, params)
    drafted, output = [], None
    while engine.has_unfinished_requests():
        before = engine.speculator.stats.num_drafts
        for out in engine.step():
            output = out.outputs[0].token_ids
        drafted.append(engine.speculator.stats.num_drafts > before)
    assert output == plain
    pattern = _pattern(drafted)
    assert True in drafted[60:], pattern
    resumed = drafted.index(True, 60)
    assert sum(drafted[resumed:]) >= len(drafted[resumed:]) / 3, pattern
