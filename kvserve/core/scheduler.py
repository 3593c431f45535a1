"""Iteration-level (continuous) batching with a token budget and chunked prefill.

Each step: running requests first (decodes and unfinished prefill chunks), in
admission order; then waiting requests while the token budget and ``max_num_seqs``
allow. When the KV manager has no room, the scheduler preempts by recompute: the
victim (latest arrival among those not yet scheduled this step, lowest priority
first under the priority policy) frees all its blocks and returns to the head of the
waiting queue (to its priority's place under the priority policy). A request that
could never fit alone is refused at admission, so a lone running request always fits
and the engine cannot deadlock.

Which waiting requests may be admitted is the batching policy's call
(:mod:`kvserve.core.batching`: continuous, length-bucket, static). Under continuous
batching with ``prefill_join_tokens`` set, a waiting request joins only while the
step's prefill tokens are fewer than that, so two prompts that arrive together finish
in consecutive steps and the first one's first token is not held back by the second's
prefill. Under the priority policy a waiting request that outranks a running one is
admitted before the running requests are scheduled, preempting the lowest-priority
running requests until it fits.

Background requests (batch API lines) are a class below every other request, under
either policy: they wait behind all foreground requests, a waiting foreground request
preempts a running background one to get in, they are the first victims under memory
pressure, and while foreground requests are there they compute at most
``background_step_tokens`` tokens a step, so their prompts never make a realtime
decode step long. "There" lingers for FOREGROUND_LINGER_S after the last foreground
request left: under steady realtime traffic the gaps between requests are not filled
with long background steps that a new arrival would have to wait for.

The scheduler owns each request's lifecycle: it alone decides that a request is finished
and why (:meth:`Scheduler.update` for a stop, :meth:`Scheduler.finish_request` for the
rest). Each :meth:`Scheduler.schedule` that runs something attaches a
:class:`SchedulerStats` to its output. Speculative decoding's guesses reach it through
:meth:`Scheduler.set_drafts`; a decode carries them into the next step while the budget,
``max_tokens`` and the KV pool leave room.
"""
from __future__ import annotations

import logging
import time
from collections import deque

from kvserve.config.scheduler import SchedulerConfig
from kvserve.core.batching import create_batching_policy
from kvserve.core.kv import KVCacheManager
from kvserve.core.scheduler_output import PromptLogprobsInfo, SamplingInfo, \
    ScheduledRequest, SchedulerOutput, SchedulerStats
from kvserve.logger import init_logger
from kvserve.request import Request, RequestStatus

logger = init_logger(__name__)

FOREGROUND_LINGER_S = 5.0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 max_loras: int | None = None) -> None:
        """``max_loras``: the most LoRA adapters running requests may use at once (the
        worker's slots); a waiting request for another adapter waits, and requests
        behind it are admitted past it."""
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        # 0 means no limit; static and length-bucket batches are admitted together
        limited = config.batching == "continuous" and config.prefill_join_tokens > 0
        self.prefill_join_tokens = config.prefill_join_tokens if limited else float("inf")
        self.priority_first = config.scheduling_policy == "priority"
        self.background_step_tokens = config.background_step_tokens
        self._foreground_seen = float("-inf")  # when a foreground request was last there
        self.swap_mode = config.swap_on_preemption
        self.kv = kv
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: list[str] = []
        self._drafts: dict[str, list[int]] = {}  # the next step's guesses, by request id
        self.batching = create_batching_policy(config)
        self.num_preemptions = 0
        self.max_loras = max_loras

    # -- requests in and out ---------------------------------------------------------

    def add_request(self, req: Request) -> None:
        capacity = self.kv.max_request_tokens()
        if req.max_total_tokens > capacity:
            raise ValueError(
                f"request {req.request_id} needs KV room for {req.max_total_tokens} tokens "
                f"(prompt {req.num_prompt_tokens} + max_tokens {req.max_tokens}) but the KV "
                f"cache holds at most {capacity} tokens for one request; lower max_tokens or "
                "raise kv_cache_memory / num_kv_blocks")
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self._enqueue(req)

    def _rank(self, req: Request) -> tuple[bool, int]:
        """Lower runs first: foreground before background, then priority (its policy)."""
        return req.background, req.priority if self.priority_first else 0

    def _enqueue(self, req: Request, front: bool = False) -> None:
        """Waiting stays sorted by rank; within a rank by arrival under the priority
        policy, else in queue order (a preempted request goes to its rank's front)."""
        rank = self._rank(req)
        if self.priority_first:
            key = (*rank, req.arrival_time)
            idx = next((i for i, o in enumerate(self.waiting)
                        if key < (*self._rank(o), o.arrival_time)), len(self.waiting))
        elif front:
            idx = next((i for i, o in enumerate(self.waiting) if self._rank(o) >= rank),
                       len(self.waiting))
        else:
            idx = next((i for i, o in enumerate(self.waiting) if self._rank(o) > rank),
                       len(self.waiting))
        self.waiting.insert(idx, req)

    def finish_request(self, request_id: str, status: RequestStatus,
                       stop_reason: int | str | None = None) -> Request | None:
        """Remove a request (stop, abort or error) and free its KV blocks at once; the
        only place a request becomes finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = status
        req.stop_reason = stop_reason
        req.finished_time = time.monotonic()
        self._finished_ids.append(request_id)
        return req

    def set_drafts(self, drafts: dict[str, list[int]]) -> None:
        """The draft tokens running requests may carry in the next step for it to verify
        (request id -> guessed next tokens), in place of any set before."""
        self._drafts = drafts

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def stats(self, scheduled: list[ScheduledRequest] = (),
              preempted: list[str] = ()) -> SchedulerStats:
        decodes = sum(1 for s in scheduled
                      if s.sampling is not None and len(s.token_ids) == s.num_draft_tokens + 1)
        return SchedulerStats(num_running=len(self.running), num_waiting=len(self.waiting),
                              num_preemptions=self.num_preemptions, kv=self.kv.stats(),
                              num_scheduled_tokens=sum(len(s.token_ids) for s in scheduled),
                              num_scheduled_requests=len(scheduled),
                              num_decode_requests=decodes, preempted=tuple(preempted),
                              **self._lora_names())

    def _lora_names(self) -> dict[str, tuple[str, ...]]:
        if self.max_loras is None:
            return {}
        return {f"{which}_loras": tuple(sorted({r.lora_request.lora_name for r in queue
                                                if r.lora_request is not None}))
                for which, queue in (("running", self.running), ("waiting", self.waiting))}

    # -- one step ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        now = time.monotonic()

        i = 0
        background = any(r.background for r in self.running)
        if background:  # foreground first, each class in admission order
            self.running.sort(key=lambda r: r.background)
        if self.priority_first or background:
            i, budget = self._admit_outranking(budget, now, scheduled, preempted)
        num_priority_preempted = len(preempted)
        # background tokens this step: capped while foreground requests are (or were
        # lately) there
        if (any(not r.background for r in self.running)
                or (self.waiting and not self.waiting[0].background)):
            self._foreground_seen = now
        foreground = now - self._foreground_seen < FOREGROUND_LINGER_S
        bg_left = self.background_step_tokens if foreground else budget
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if req.background:
                num_new = min(num_new, bg_left)
                if num_new == 0:  # the rest of running is background too
                    break
            drafts = self._take_drafts(req, num_new, budget)
            if drafts and self.kv.allocate_slots(req, num_new + len(drafts)):
                scheduled.append(self._scheduled(req, num_new, drafts))
                budget -= num_new + len(drafts)
                bg_left -= (num_new + len(drafts)) if req.background else 0
                i += 1
                continue
            while not self.kv.allocate_slots(req, num_new):  # no drafts when memory is short
                victim = self._pick_victim(i)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                scheduled.append(self._scheduled(req, num_new))
                budget -= num_new
                bg_left -= num_new if req.background else 0
                i += 1

        if len(preempted) == num_priority_preempted:  # no memory pressure this step
            prefill = sum(len(s.token_ids) for s in scheduled if len(s.token_ids) > 1)
            for req in self.batching.admissible(self.waiting, now):
                if prefill >= self.prefill_join_tokens:
                    break
                if not self._lora_fits(req):
                    continue
                room = min(budget, bg_left) if req.background else budget
                num_new = self._try_admit(req, room, now, scheduled) if room > 0 else 0
                if not num_new:
                    break
                budget -= num_new
                bg_left -= num_new if req.background else 0
                prefill += num_new

        # taken only for steps that run something (a KV snapshot walks every table)
        stats = self.stats(scheduled, preempted) if scheduled else None
        if stats is not None and logger.isEnabledFor(logging.DEBUG):
            self._log_step(stats)
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(scheduled=scheduled, preempted=preempted,
                               block_copies=self.kv.take_block_copies(),
                               kv_transfers=self.kv.take_transfers(), finished_ids=finished,
                               stats=stats)

    def _try_admit(self, req: Request, budget: int, now: float,
                   scheduled: list[ScheduledRequest]) -> int:
        """Admit a waiting request if max_num_seqs and the KV allow; returns the tokens
        scheduled for it (0: not admitted, nothing changed)."""
        if not self._lora_fits(req):
            return 0
        if self.kv.is_swapped(req):  # its KV comes back from swap space
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if len(self.running) >= self.max_num_seqs or not self.kv.swap_in(req, num_new):
                return 0
        else:
            wants_prompt = req.sampling_params.prompt_logprobs is not None
            if req.num_computed_tokens == 0 and not wants_prompt:  # reuse cached prefixes
                # (not for prompt logprobs: a cached prompt token's row is never computed)
                # a mean or first-token pooling reads every prompt row: none from the cache
                pools_all = req.pooling is not None and req.pooling.pooling != "last"
                req.num_computed_tokens = 0 if pools_all else self.kv.get_computed_tokens(req)
                if req.num_preemptions == 0:
                    req.num_cached_tokens = req.num_computed_tokens
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if (len(self.running) >= self.max_num_seqs
                    or not self.kv.allocate_slots(req, num_new)):
                self.kv.free(req)  # drop the prefix hits it took; retried next step
                req.num_computed_tokens = 0
                return 0
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        req.first_scheduled_time = req.first_scheduled_time or now
        self.running.append(req)
        scheduled.append(self._scheduled(req, num_new))
        return num_new

    def running_loras(self) -> set[int]:
        """The adapters (lora_int_id) of the running requests."""
        return {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}

    def _lora_fits(self, req: Request) -> bool:
        """Whether admitting ``req`` keeps the running adapters within max_loras."""
        if req.lora_request is None or self.max_loras is None:
            return True
        running = self.running_loras()
        return req.lora_request.lora_int_id in running or len(running) < self.max_loras

    def _admit_outranking(self, budget: int, now: float, scheduled: list[ScheduledRequest],
                          preempted: list[str]) -> tuple[int, int]:
        """Priority policy, before running requests are scheduled: admit waiting requests
        that outrank a running one, preempting the lowest-priority running request (latest
        arrival among equals) until each fits. Admitted requests move to the front of
        ``running``; returns (how many, budget left)."""
        n = 0
        while self.waiting and budget > 0:
            req = self.waiting[0]
            lower = [r for r in self.running[n:] if self._rank(r) > self._rank(req)]
            if not lower:
                break
            num_new = self._try_admit(req, budget, now, scheduled)
            if num_new:
                self.running.insert(n, self.running.pop())
                n += 1
                budget -= num_new
                continue
            victim = max(lower, key=lambda r: (*self._rank(r), r.arrival_time))
            self._preempt(victim)
            preempted.append(victim.request_id)
        return n, budget

    @staticmethod
    def _log_step(stats: SchedulerStats) -> None:
        kv = stats.kv
        logger.debug("step: %d running, %d waiting; KV %d/%d blocks, utilisation %.1f%%, "
                     "fragmentation internal %.1f%% external %.1f%%; preemptions %d, "
                     "moved blocks %d", stats.num_running, stats.num_waiting,
                     kv.num_used_blocks, kv.num_blocks, 100 * kv.utilization,
                     100 * kv.internal_fragmentation, 100 * kv.external_fragmentation,
                     stats.num_preemptions, kv.moved_blocks)

    def _take_drafts(self, req: Request, num_new: int, budget: int) -> list[int]:
        """A decode's draft tokens, as many as the budget and max_tokens leave room for
        (a step yields at most one token more than the drafts it verifies)."""
        drafts = self._drafts.pop(req.request_id, None)
        if not drafts or num_new != 1 or req.num_computed_tokens + 1 != req.num_tokens:
            return []
        room = min(budget - 1, req.max_tokens - req.num_output_tokens - 1)
        return drafts[:max(0, room)]

    def _scheduled(self, req: Request, num_new: int, drafts: list[int] | None = None
                   ) -> ScheduledRequest:
        start = req.num_computed_tokens
        ends_prompt = start + num_new == req.num_tokens
        sampling = SamplingInfo(req.sampling_params, req.prompt_token_ids,
                                req.output_token_ids, req.eos_token_id) \
            if ends_prompt and req.pooling is None else None
        tokens = req.token_slice(start, start + num_new)
        k = req.sampling_params.prompt_logprobs
        prompt = (PromptLogprobsInfo(k, req.prompt_token_ids)
                  if k is not None and start < req.num_prompt_tokens else None)
        tables = self.kv.group_tables(req)
        return ScheduledRequest(
            request_id=req.request_id, token_ids=tokens + drafts if drafts else tokens,
            start_pos=start, block_table=list(tables[0]), sampling=sampling,
            num_draft_tokens=len(drafts) if drafts else 0, prompt_logprobs=prompt,
            group_tables=tuple(tables[1:]), pooling=req.pooling,
            pool_done=req.pooling is not None and ends_prompt, lora=req.lora_request)

    def _pick_victim(self, first_unscheduled: int) -> Request:
        candidates = self.running[first_unscheduled:]
        return max(candidates, key=lambda r: (*self._rank(r), r.arrival_time))

    def _preempt(self, req: Request) -> None:
        """Swap the victim's KV out when configured and there is room, else drop it."""
        self.running.remove(req)
        if not (self.swap_mode and self.kv.swap_out(req)):
            self.kv.free(req)
            req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req, front=True)

    def update(self, output: SchedulerOutput, sampled: dict[str, list[int] | int]
               ) -> list[tuple[Request, int]]:
        """Advance requests by what the step computed; returns each request that got
        tokens with how many it kept.

        A request's tokens are the drafts the step accepted plus one more (a single
        token without drafts); rejected drafts' KV slots are given back. A request that
        stops (EOS, stop_token_ids, max_tokens) keeps the tokens up to the stop and
        finishes here; stop strings are found in the text afterwards
        (:meth:`finish_on_stop_strings`).
        """
        now = time.monotonic()
        progressed = []
        for sr in output.scheduled:
            req = self.requests.get(sr.request_id)
            if req is None:  # finished while the step ran
                continue
            tokens = sampled.get(sr.request_id)
            tokens = [tokens] if isinstance(tokens, int) else tokens
            if sr.num_draft_tokens:
                accepted = len(tokens) - 1
                req.num_computed_tokens += len(sr.token_ids) - sr.num_draft_tokens + accepted
                self.kv.truncate(req, req.num_computed_tokens)
            else:
                req.num_computed_tokens += len(sr.token_ids)
            if req.pooling is not None and req.num_computed_tokens >= req.num_prompt_tokens:
                self.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                progressed.append((req, 0))  # pooled: finished with no token
                continue
            if not tokens:
                continue
            req.first_token_time = req.first_token_time or now
            kept = 0
            for token in tokens:
                req.output_token_ids.append(token)
                kept += 1
                stop = self._stop(req, token)
                if stop is not None:
                    self.finish_request(req.request_id, *stop)
                    break
            progressed.append((req, kept))
        return progressed

    def finish_on_stop_strings(self, stops: dict[str, tuple[str, int]]) -> None:
        """Finish requests whose new text hit a stop string: request id -> (the string,
        how many of the step's tokens came after the one completing it: dropped)."""
        for rid, (stop, after) in stops.items():
            req = self.requests.get(rid)
            if req is None:
                continue
            if after > 0:
                del req.output_token_ids[-after:]
            self.finish_request(rid, RequestStatus.FINISHED_STOPPED, stop)

    @staticmethod
    def _stop(req: Request, token: int) -> tuple[RequestStatus, int | None] | None:
        """(status, stop_reason) if ``token`` ends the request."""
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            if token == req.eos_token_id and not sp.ignore_eos:
                return RequestStatus.FINISHED_STOPPED, None
            if token in sp.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
        if req.num_output_tokens >= req.max_tokens:
            return RequestStatus.FINISHED_LENGTH, None
        return None
