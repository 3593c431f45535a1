"""Speculation in the engine: greedy tokens are transformers' in every mode, sampled
output keeps its distribution, stop strings and limits hold, no KV block is lost.

Most tests draft with :class:`OracleProposer` (the true continuation, every sixth token
wrong), so acceptance and rejection happen at every draft position; prompt lookup
itself is tested on the embedded model, which does copy code it has seen."""
from __future__ import annotations

import collections
import math

import pytest

from kvserve import LLM, EngineArgs, SamplingParams
from kvserve.spec_decode import PROPOSERS
from tests.helpers import flat_step_cost, hf_greedy, prompts_of_lengths
from tests.spec_decode.oracle_proposer import OracleProposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
ORACLE = {"method": "oracle", "num_speculative_tokens": 4}
MAX_NEW = 24


def repetitive_prompts() -> list[list[int]]:
    """Prompts that repeat pieces of themselves, so prompt lookup finds matches."""
    out = []
    for i, base in enumerate(prompts_of_lengths([5, 9, 14, 3, 20, 7], seed=3)):
        out.append(base * (2 + i % 3) + base[: 1 + i % len(base)])
    return out + prompts_of_lengths([6, 33])


@pytest.fixture(scope="module")
def prompts():
    return repetitive_prompts()


@pytest.fixture(scope="module")
def oracle(llama_dir, prompts):
    return hf_greedy(llama_dir, prompts, MAX_NEW)


@pytest.fixture(autouse=True)
def flat_cost(monkeypatch):
    """The start-up costs alone decide the drafts (steps priced flat, not measured as
    they run): these tests are about what verification does with drafts, and need
    drafts made the same way on a busy machine as on an idle one
    (test_measured_yield_engine.py covers what measuring as they run decides)."""
    from kvserve.spec_decode import controller
    flat_step_cost(monkeypatch)
    monkeypatch.setattr(controller, "LEARN_FROM_STEPS", False)


@pytest.fixture(autouse=True)
def oracle_proposer(prompts, oracle):
    OracleProposer.continuations = {tuple(p): o for p, o in zip(prompts, oracle)}
    PROPOSERS.register("oracle", OracleProposer)
    yield
    PROPOSERS.unregister("oracle")


def _greedy(llm, prompts, max_new=MAX_NEW):
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("settings", [
    {},
    {"kv_manager": "buddy"},
    {"kv_manager": "contiguous"},
    {"block_size": 4, "max_num_batched_tokens": 16},                # chunked, tight budget
    {"num_kv_blocks": 24, "block_size": 8},                          # preemption
    {"num_kv_blocks": 24, "block_size": 8, "preemption_mode": "swap"},
    {"attention_backend": "torch"},
    {"max_num_seqs": 1},                                             # single stream
], ids=["paged", "buddy", "contiguous", "chunked", "preempt", "swap", "torch", "single"])
def test_greedy_tokens_are_transformers(settings, llama_dir, prompts, oracle):
    llm = LLM(llama_dir, speculative_config=ORACLE, **settings)
    assert _greedy(llm, prompts) == oracle
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, \
        "no draft verified: the test lost its point"
    assert stats.num_accepted_tokens < stats.num_draft_tokens, "no draft rejected"
    assert sum(1 for n in stats.accepted_per_position if n) >= 2, "only first drafts accepted"
    assert llm.engine.kv.stats().num_used_blocks == 0, "blocks leaked"


def test_prefix_cache_never_holds_a_rejected_token(llama_dir, prompts, oracle):
    llm = LLM(llama_dir, speculative_config=ORACLE, block_size=4)
    assert _greedy(llm, prompts) == oracle
    # the same prompts again find their blocks cached: what is cached must be right
    assert _greedy(llm, prompts) == oracle
    assert llm.engine.kv.stats().prefix_hits > 0


@pytest.mark.parametrize("settings", [{"quantization": "int8"}, {"kv_cache_dtype": "float16"}],
                         ids=["int8", "fp16-kv"])
def test_speculation_changes_nothing_in_approximate_modes(settings, llama_dir, prompts):
    plain = _greedy(LLM(llama_dir, **settings), prompts)
    spec = LLM(llama_dir, speculative_config=ORACLE, **settings)
    assert _greedy(spec, prompts) == plain
    assert spec.engine.speculator.stats.num_accepted_tokens > 0


def test_stop_strings_and_stop_tokens_cut_where_plain_decoding_does(llama_dir, prompts):
    plain_llm = LLM(llama_dir)
    base = _greedy(plain_llm, prompts[:4])
    tok = plain_llm.get_tokenizer()
    params = []
    for tokens in base:  # stop on a piece of text / a token from the middle of the output
        text = tok.decode(tokens[:12], skip_special_tokens=True)
        params.append(SamplingParams(temperature=0.0, max_tokens=MAX_NEW,
                                     stop=[text[-3:]] if text.strip() else None,
                                     stop_token_ids=[tokens[7]]))
    runs = []
    for llm in (plain_llm, LLM(llama_dir, speculative_config=ORACLE)):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params,
                            use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
                      o.outputs[0].stop_reason) for o in outs])
        assert llm.engine.kv.stats().num_used_blocks == 0
    assert runs[0] == runs[1]


@pytest.mark.slow  # (15-25 s: `make test` stays near 10 minutes)
def test_sampled_continuations_keep_their_distribution(llama_dir):
    """The first two tokens of three-token continuations of one prompt, sampled many times
    with and without speculation: the same distribution. With speculation the second
    token is verified against a draft: the second token that a separate pilot run of
    plain sampling drew most often after that first token (chosen apart from the
    compared samples, whose counts it would bias), so drafts are accepted often and
    rejected often."""
    prompt = repetitive_prompts()[0]
    params = SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True)

    def sample(spec, seed, n):
        # one at a time: with many running, a draft would not pay and none would be made
        llm = LLM(llama_dir, speculative_config=spec, seed=seed, max_num_seqs=1)
        outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
        return collections.Counter(tuple(o.outputs[0].token_ids[:2]) for o in outs), llm

    pilot, _ = sample(None, 3, 600)
    by_first = collections.defaultdict(collections.Counter)
    for (first, second), n in pilot.items():
        by_first[first][second] += n
    OracleProposer.next_token = {tuple(prompt) + (first,): c.most_common(1)[0][0]
                                 for first, c in by_first.items()}
    try:
        plain, _ = sample(None, 5, 1500)
        spec, llm = sample({**ORACLE, "num_speculative_tokens": 1}, 11, 1500)
    finally:
        OracleProposer.next_token = {}
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 1200, stats
    assert 200 < stats.num_accepted_tokens < stats.num_draft_tokens - 200, stats
    keys = [k for k in set(plain) | set(spec) if plain[k] + spec[k] >= 10]
    table = [[c[k] for k in keys] + [sum(c[k] for k in c if k not in keys)]
             for c in (plain, spec)]
    assert _two_sample_p(table) > 1e-3


def _two_sample_p(table: list[list[int]]) -> float:
    """Chi-square test of homogeneity for two rows of counts (Wilson-Hilferty)."""
    cols = [a + b for a, b in zip(*table)]
    rows = [sum(r) for r in table]
    n = sum(rows)
    stat = sum((table[i][j] - rows[i] * cols[j] / n) ** 2 / (rows[i] * cols[j] / n)
               for i in range(2) for j in range(len(cols)) if cols[j])
    dof = len([c for c in cols if c]) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("bad, message", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a "
                                                       "positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "at most 16"),
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown field"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "must not exceed"),
    ("{not json", "not valid JSON"),
])
def test_bad_configs_are_refused_naming_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(speculative_config=bad)


def test_a_kv_manager_without_truncate_is_refused(llama_dir):
    from kvserve.core.kv import KV_MANAGERS
    from tests.core.stack_kv_manager import StackKVCacheManager
    KV_MANAGERS.register("stack", StackKVCacheManager)
    try:
        with pytest.raises(ValueError, match="'stack' cannot give back"):
            EngineArgs(model=llama_dir, kv_manager="stack",
                       speculative_config=NGRAM).create_engine_config()
    finally:
        KV_MANAGERS.unregister("stack")


def test_prompt_lookup_drafts_get_accepted_on_code_the_model_copies():
    """The embedded model re-emitting a function it was just shown: prompt lookup's
    drafts are accepted, and the tokens are those of plain decoding."""
    code = ("def add_numbers(first, second):\n    total = first + second\n"
            "    return total\n\n\ndef subtract_numbers(first, second):\n"
            "    difference = first - second\n    return difference\n\n\n")
    prompt = code + code + "def add_numbers("
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = LLM().generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(speculative_config=NGRAM)
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == plain
    stats = llm.engine.speculator.stats
    assert stats.num_accepted_tokens >= 5, stats


def test_step_cost_is_measured_at_start_within_the_models_positions(llama_dir, monkeypatch):
    from kvserve.worker.cpu_worker import CPUWorker
    monkeypatch.undo()  # the real measurement
    llm = LLM(llama_dir, speculative_config=NGRAM, max_num_seqs=256)
    cost = llm.engine.speculator.cost
    rows = [int(r) for r in cost.rows]
    assert rows[0] == 1 and 256 <= rows[-1] <= 512 - 128  # context 128 + rows fit 512
    assert all(t > 0 for t in cost.seconds) and cost(rows[-1]) > cost(1)
    worker = llm.engine.worker  # the compute thread's wrapper, around the CPU worker
    assert isinstance(getattr(worker, "inner", worker), CPUWorker)


def test_drafts_are_verified_under_the_requests_logit_bias(llama_dir, prompts):
    """The verifier processes rows as the sampler does: a bias that changes greedy
    tokens changes them identically with and without speculation."""
    bias = {t: -5.0 for t in range(2, 300, 7)}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True,
                            logit_bias=bias, presence_penalty=0.5)
    runs = []
    for spec in (None, ORACLE):
        llm = LLM(llama_dir, speculative_config=spec)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
        if spec:
            assert llm.engine.speculator.stats.num_accepted_tokens > 0
    assert runs[0] == runs[1]
