"""Drive the real Scheduler and a KV manager without a model, checking KV contents.

A fake runner keeps, for every KV slot, a fingerprint of what a real runner would have
written there: the hash of the token prefix that ends at that position (the K/V of a
position depend on exactly that). Each step it does the block copies, then the writes,
and checks that every scheduled request's block table reaches, for each position it
attends to, a slot holding that position's fingerprint. Block copies are applied as one
gather-then-scatter (what ModelRunner does) and also pair by pair in order; both must
agree, so a copy list never depends on how it is executed.

With KV groups (``windows``: per group, 0 for full attention or its window), each group
writes through its own table and a slot's fingerprint is tagged with the group that
wrote it; a group reads each query's window only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.engine_args import EngineArgs
from kvserve.core.kv import create_kv_manager
from kvserve.core.kv.groups import KVGroups
from kvserve.core.scheduler import Scheduler
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

VOCAB = 1000


@dataclass
class SimResult:
    steps: int = 0
    preemptions: int = 0
    moved_blocks: int = 0
    peak_running: int = 0
    copies: int = 0
    same_step_reuse: int = 0   # copy sources handed to another request in the same step
    outputs: dict[str, list[int]] = field(default_factory=dict)
    utilization: list[float] = field(default_factory=list)


def make_request(rid: str, prompt: list[int], max_tokens: int, arrival: float = 0.0,
                 priority: int = 0) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   eos_token_id=None, max_tokens=max_tokens, arrival_time=arrival,
                   priority=priority)


class _Prints:
    """Fingerprint of each token prefix: f(p) = hash((f(p - 1), token p)), grown lazily."""

    def __init__(self) -> None:
        self._prints: dict[str, list[int]] = {}

    def of(self, req: Request) -> list[int]:
        fp = self._prints.setdefault(req.request_id, [])
        tokens = req.prompt_token_ids + req.output_token_ids
        for tok in tokens[len(fp):]:
            fp.append(hash((fp[-1] if fp else 0, tok)))
        return fp


def _next_token(prints: list[int]) -> int:
    return prints[-1] % VOCAB


def simulate(args: EngineArgs, num_blocks: int, requests: list[Request],
             max_steps: int = 20_000, arrivals: dict[int, list[Request]] | None = None,
             clock: list[float] | None = None, windows: tuple[int, ...] | None = None
             ) -> SimResult:
    """Run ``requests`` to completion; ``arrivals`` adds more before given steps."""
    groups = None if windows is None else KVGroups(windows, (), (), 1)
    kv = create_kv_manager(args.create_cache_config(), num_blocks, groups=groups,
                           step_tokens=args.max_num_batched_tokens)
    windows = windows or (0,)
    sched = Scheduler(args.create_scheduler_config(), kv)
    for req in requests:
        sched.add_request(req)
    all_reqs = {r.request_id: r for r in requests}
    bs = args.block_size
    content: dict[int, int] = {}
    prints = _Prints()
    res = SimResult()
    step = 0
    while sched.has_unfinished() or (arrivals and any(k >= step for k in arrivals)):
        for req in (arrivals or {}).get(step, []):
            sched.add_request(req)
            all_reqs[req.request_id] = req
        step += 1
        assert step < max_steps, "no progress"
        if clock is not None:
            clock[0] += 0.01
        out = sched.schedule()
        if out.scheduled:
            res.peak_running = max(res.peak_running, out.stats.num_running)
        # copies: gather-then-scatter, and in order; both must agree
        gathered = {d * bs + j: content.get(s * bs + j)
                    for s, d in out.block_copies for j in range(bs)}
        in_order = dict(content)
        for s, d in out.block_copies:
            for j in range(bs):
                in_order[d * bs + j] = in_order.get(s * bs + j)
        content.update(gathered)
        assert content == in_order, "block copies depend on execution order"
        res.copies += len(out.block_copies)
        dsts = {d for _, d in out.block_copies}
        srcs = {s for s, _ in out.block_copies}
        # writes of the step
        tables = {}
        for sr in out.scheduled:
            req = sched.requests[sr.request_id]
            tokens = req.prompt_token_ids + req.output_token_ids
            fp = prints.of(req)
            end = sr.start_pos + len(sr.token_ids)
            assert sr.token_ids == tokens[sr.start_pos:end]
            group_tables = (sr.block_table, *sr.group_tables)
            assert len(group_tables) == len(windows)
            for g, table in enumerate(group_tables):
                assert len(table) == kv.blocks_for(end), "table length != blocks needed"
                tables[(sr.request_id, g)] = table
                for pos in range(sr.start_pos, end):
                    content[table[pos // bs] * bs + pos % bs] = (g, fp[pos])
        # no two requests (or groups) share a writable block; a copy source reused in
        # the step; a block a window gave back reads as block 0 and is never written
        owners: dict[int, tuple[str, int]] = {}
        for (rid, g), table in tables.items():
            sr = next(s for s in out.scheduled if s.request_id == rid)
            first = max(0, sr.start_pos - windows[g] + 1) // bs if windows[g] else 0
            for b in table[first:]:
                assert 0 <= b < kv.num_blocks
                if b in srcs and b not in dsts:
                    res.same_step_reuse += 1
                other = owners.setdefault(b, (rid, g))
                shared = args.kv_manager == "paged" and args.enable_prefix_caching
                assert other == (rid, g) or (shared and other[1] == g), \
                    f"block {b} held by {other} and {(rid, g)}"
        # reads of the step: each query position its window's keys
        for sr in out.scheduled:
            fp = prints.of(sched.requests[sr.request_id])
            for g, w in enumerate(windows):
                table = tables[(sr.request_id, g)]
                first = max(0, sr.start_pos - w + 1) if w else 0
                for pos in range(first, sr.start_pos + len(sr.token_ids)):
                    slot = table[pos // bs] * bs + pos % bs
                    assert content.get(slot) == (g, fp[pos]), (
                        f"{sr.request_id} group {g} reads wrong KV at position {pos} "
                        f"(step {step})")
        st = kv.stats()
        assert st.used_tokens <= st.allocated_slots <= st.num_blocks * bs, st
        assert 0 <= st.unusable_free_blocks <= st.num_blocks - st.num_used_blocks
        if out.scheduled:
            res.utilization.append(st.utilization)
        sampled = {}
        for sr in out.scheduled:
            if sr.sample:
                sampled[sr.request_id] = _next_token(prints.of(sched.requests[sr.request_id]))
        sched.update(out, sampled)
    assert kv.stats().num_used_blocks == 0, "blocks leaked"
    if hasattr(kv, "buddy"):
        kv.buddy.check()
        assert kv.buddy.num_free == kv.num_blocks
    res.steps = step
    res.preemptions = sched.num_preemptions
    res.moved_blocks = kv.stats().moved_blocks
    res.outputs = {rid: r.output_token_ids for rid, r in all_reqs.items()}
    for rid, r in all_reqs.items():
        fp = prints.of(r)
        for i, tok in enumerate(r.output_token_ids):
            assert tok == _next_token(fp[:r.num_prompt_tokens + i]), f"{rid} outputs differ"
    return res
