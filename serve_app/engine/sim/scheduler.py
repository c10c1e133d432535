"""vLLM v1's scheduler, in pure Python, for the simulated engine: one ``schedule`` per step.

What it keeps of vLLM (``vllm/v1/core/sched/scheduler.py``):

- continuous batching: every step first gives the running requests their next tokens (a decode
  token, or the next chunk of a prefill), then admits waiting requests while fewer than
  ``max_num_seqs`` run and the step's token budget (``max_num_batched_tokens``) lasts;
- chunked prefill: a prompt longer than what is left of the budget is computed over several steps;
- prefix caching: a new request starts after its longest cached prefix (``blocks.BlockPool``);
- priority policy: waiting requests are taken by (priority, arrival), lower first; fcfs by arrival;
- preemption by recompute: when a running request needs a block and none is free, the running
  request that comes last (the largest (priority, arrival) under priority, the latest under fcfs)
  loses its blocks and waits again from the start (its prefix may still be cached). A waiting
  request never preempts a running one.

The step itself is not run here: ``schedule`` returns the ``Batch``, the caller waits the step's
modelled time and then calls ``complete``, which advances the requests and makes their tokens.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

from serve_app.engine.sim.blocks import BlockPool, chain_hashes
from serve_app.engine.sim.profile import StepWork, prefill_pairs
from serve_app.engine.sim.tokens import VOCAB

Policy = Literal["fcfs", "priority"]


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class SimRequest:
    """One request in the simulated engine; times are modelled seconds."""

    id: str
    prompt: list[int]
    max_tokens: int
    priority: int = 0
    salt: str = ""
    arrival: float = 0.0
    seq: int = 0  # submission order: the tie-break of equal arrivals
    status: Status = Status.WAITING
    outputs: list[int] = field(default_factory=list)
    num_computed: int = 0
    cached_tokens: int = -1  # prefix hit at its first scheduling; -1 until scheduled
    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0  # of ``blocks``, those indexed by hash
    num_preemptions: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.outputs)

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.ABORTED)

    def order(self) -> tuple[int, float, int]:
        """The priority policy's order: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival, self.seq)


@dataclass(frozen=True)
class Scheduled:
    """One request's share of a step: ``new`` tokens computed after ``context`` tokens."""

    request: SimRequest
    new: int
    context: int

    @property
    def decode(self) -> bool:
        return self.new == 1 and self.context >= len(self.request.prompt)


@dataclass
class Batch:
    """One step: what runs in it, and who was preempted to make room."""

    scheduled: list[Scheduled] = field(default_factory=list)
    preempted: list[SimRequest] = field(default_factory=list)

    def work(self) -> StepWork:
        """The step's totals, for the profile's step time."""
        pre = [s for s in self.scheduled if not s.decode]
        dec = [s for s in self.scheduled if s.decode]
        return StepWork(prefill_tokens=sum(s.new for s in pre),
                        prefill_attention=sum(prefill_pairs(s.new, s.context) for s in pre),
                        decode_seqs=len(dec), decode_context=sum(s.context + 1 for s in dec))


@dataclass(frozen=True)
class Limits:
    """The engine arguments that bound a step (vLLM's names)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    policy: Policy = "fcfs"
    chunked_prefill: bool = True


class Scheduler:
    """The waiting queue, the running batch and the block pool of one simulated engine."""

    def __init__(self, limits: Limits, pool: BlockPool, seed: int = 0) -> None:
        self.limits = limits
        self.pool = pool
        self.seed = seed
        self.running: list[SimRequest] = []
        self._fifo: deque[SimRequest] = deque()
        self._heap: list[tuple[tuple[int, float, int], SimRequest]] = []
        self._seq = 0
        self.preemptions = 0
        self.prompt_tokens = 0  # prompt tokens of requests that made their first token
        self.generation_tokens = 0

    # ---- the waiting queue ----------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._heap) if self.limits.policy == "priority" else len(self._fifo)

    def _peek(self) -> SimRequest:
        return self._heap[0][1] if self.limits.policy == "priority" else self._fifo[0]

    def _pop(self) -> SimRequest:
        if self.limits.policy == "priority":
            return heapq.heappop(self._heap)[1]
        return self._fifo.popleft()

    def _push(self, req: SimRequest, front: bool = False) -> None:
        if self.limits.policy == "priority":
            heapq.heappush(self._heap, (req.order(), req))
        elif front:
            self._fifo.appendleft(req)
        else:
            self._fifo.append(req)

    # ---- requests in and out ---------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.pool.block_size)

    def add(self, req: SimRequest) -> None:
        """Queue a new request (its prompt's block hashes computed once, here)."""
        self._seq += 1
        req.seq = self._seq
        req.hashes = chain_hashes(req.prompt, self.pool.block_size, req.salt)
        self._push(req)

    def abort(self, req: SimRequest) -> None:
        """Drop a request wherever it is, releasing its blocks (the client went away)."""
        if req.done:
            return
        if req in self.running:
            self.running.remove(req)
        elif req.status in (Status.WAITING, Status.PREEMPTED):
            if self.limits.policy == "priority":
                self._heap = [e for e in self._heap if e[1] is not req]
                heapq.heapify(self._heap)
            elif req in self._fifo:
                self._fifo.remove(req)
        self._free(req)
        req.status = Status.ABORTED

    def _free(self, req: SimRequest) -> None:
        self.pool.release(req.blocks)
        req.blocks = []
        req.num_cached_blocks = 0

    def _preempt(self, req: SimRequest) -> None:
        self._free(req)
        req.num_computed = 0
        req.num_preemptions += 1
        req.status = Status.PREEMPTED
        self.preemptions += 1
        self._push(req, front=True)

    def _allocate(self, req: SimRequest, new: int, hit: list[int]) -> bool:
        """Blocks for ``new`` more tokens of ``req`` after its computed ones and the cached
        ``hit``; False (nothing taken) when the pool cannot give them."""
        total = self.blocks_needed(req.num_computed + len(hit) * self.pool.block_size + new)
        fresh = total - len(req.blocks) - len(hit)
        if fresh > self.pool.num_free - self.pool.evictable(hit):
            return False
        self.pool.touch(hit)
        req.blocks.extend(hit)
        req.num_cached_blocks += len(hit)
        if fresh > 0:
            req.blocks.extend(self.pool.allocate(fresh))
        return True

    def _victim(self) -> SimRequest:
        if self.limits.policy == "priority":
            return max(self.running, key=SimRequest.order)
        return self.running[-1]

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> Batch:
        """The next step's batch: running requests first (preempting when blocks run out), then
        waiting ones while seats and the token budget last, unless this step preempted."""
        batch = Batch()
        budget = self.limits.max_num_batched_tokens
        chosen: dict[int, Scheduled] = {}  # by id(request), in scheduling order
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            new = min(req.num_tokens - req.num_computed, budget)
            placed = True
            while not self._allocate(req, new, []):
                victim = self._victim()
                self.running.remove(victim)
                gone = chosen.pop(id(victim), None)
                if gone is not None:  # preempted after it was scheduled in this step
                    budget += gone.new
                    i -= 1
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    placed = False
                    break
            if not placed:
                break
            chosen[id(req)] = Scheduled(req, new, req.num_computed)
            budget -= new
            i += 1
        while (not batch.preempted and self.num_waiting and budget > 0
               and len(self.running) < self.limits.max_num_seqs):
            req = self._peek()
            hit = self.pool.longest_hit(req.hashes, req.num_tokens - 1)
            hit_tokens = len(hit) * self.pool.block_size
            new = req.num_tokens - hit_tokens
            if new > budget and not self.limits.chunked_prefill:
                break
            new = min(new, budget)
            if not self._allocate(req, new, hit):
                break
            self._pop()
            if req.num_preemptions == 0:  # vLLM counts a resumed request's lookup apart
                self.pool.stats.queries += req.num_tokens
                self.pool.stats.hits += hit_tokens
            if req.cached_tokens < 0:
                req.cached_tokens = hit_tokens
            req.num_computed = hit_tokens
            req.status = Status.RUNNING
            self.running.append(req)
            chosen[id(req)] = Scheduled(req, new, hit_tokens)
            budget -= new
        batch.scheduled = list(chosen.values())
        return batch

    def complete(self, batch: Batch, now: float) -> list[SimRequest]:
        """The step ran: advance its requests, make a token for each that caught up, cache their
        full blocks and finish those at ``max_tokens``. Returns the requests that made a token."""
        made = []
        for s in batch.scheduled:
            req = s.request
            if req.done or req.status is not Status.RUNNING:
                continue  # aborted while its step ran
            req.num_computed = s.context + s.new
            if req.num_computed >= req.num_tokens:
                if not req.outputs:
                    req.first_token_at = now
                    self.prompt_tokens += len(req.prompt)
                req.outputs.append((self.seed * 1_000_003 + req.seq * 7919 + len(req.outputs)) % VOCAB)
                req.last_token_at = now
                self.generation_tokens += 1
                made.append(req)
            self._cache_full_blocks(req)
            if len(req.outputs) >= req.max_tokens:
                self.running.remove(req)
                self._free(req)
                req.status = Status.FINISHED
                req.finished_at = now
        return made

    def _cache_full_blocks(self, req: SimRequest) -> None:
        known = min(req.num_computed, req.num_tokens)
        if known // self.pool.block_size <= len(req.hashes):
            hashes = req.hashes[:known // self.pool.block_size]
        else:
            ids = req.prompt + req.outputs
            req.hashes = chain_hashes(ids[:known], self.pool.block_size, req.salt, start=req.hashes)
            hashes = req.hashes
        start = req.num_cached_blocks
        self.pool.cache(req.blocks[start:len(hashes)], hashes[start:])
        req.num_cached_blocks = max(start, len(hashes))
