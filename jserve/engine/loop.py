"""The one engine loop; the runner decides whether it is real JAX or a simulation."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from jserve.cache.prefix import CacheSnapshot, EvictionRule
from jserve.engine.batch import Batch, RepeatedSteps, StepOutput
from jserve.engine.plan import Plan
from jserve.engine.policy import Policy
from jserve.engine.request import Request
from jserve.engine.sampling_params import SamplingParams
from jserve.engine.state import EngineState
from jserve.engine.token_commit import Booked
from jserve.errors import PlanError


class Runner(Protocol):
    # Whether `execute` reads `batch.inputs` (token ids, block tables, sampling settings).
    needs_inputs: bool

    def execute(self, batch: Batch) -> StepOutput: ...


class PendingOutput(Protocol):
    def result(self) -> StepOutput: ...


@runtime_checkable
class DispatchingRunner(Runner, Protocol):
    """A runner whose step runs on while the host plans the next one (the JAX runner): a
    batch token the host has not read (`PLACEHOLDER`) is the one its sequence sampled in
    the previous dispatched step, which the runner takes from the device."""

    def dispatch(self, batch: Batch) -> PendingOutput: ...


@runtime_checkable
class RepeatingRunner(Runner, Protocol):
    """A runner that can run several decode steps of one batch in a call (the simulator's
    prices them all at once; see `Plan.repeat`)."""

    def repeat_decodes(self, batch: Batch, steps: int, until: float) -> RepeatedSteps:
        """Up to `steps` more steps of `batch`'s decodes, each sequence one token further
        each time, stopping before a step that would start at or after `until`."""
        ...


@dataclass
class EngineStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_swaps: int = 0  # preemptions that moved K/V to host memory
    num_batched_tokens: int = 0
    num_evicted_blocks: int = 0  # prefix-cache blocks evicted


class Engine:
    """`snapshot -> schedule -> evict -> apply -> execute -> commit -> trim`, once per `step()`.

    `pipelined` (a `DispatchingRunner`, no prefix cache): asynchronous steps, as vLLM's
    async scheduling and SGLang's overlap scheduler do. Step N is dispatched, then step
    N-1's tokens are read while the device computes N, and the next call plans N+1 before
    N's tokens are read: progress and lengths are booked at dispatch (`EngineState.book`),
    tokens and the stops they make one step later (`EngineState.read`), so a request that
    an EOS or a stop string ends runs one step more, whose token is dropped. The tokens and
    everything a request returns are those of the synchronous loop.

    With a prefix cache, the eviction rule is a second pure function, asked where blocks
    are needed and where they enter the cache. Once the policy has planned, the state says
    how many cached blocks the plan needs freed and hands the rule a snapshot of the
    candidates; its choice joins the plan, and `apply` checks it too. Once a step (or an
    abort) has released histories, the rule trims the cache back to its capacity, so the
    next snapshot offers no waiting request more than the capacity keeps.
    """

    def __init__(
        self, state: EngineState, policy: Policy, runner: Runner,
        clock: Callable[[], float] = time.perf_counter, eviction: EvictionRule | None = None,
        pipelined: bool = False,
    ) -> None:
        if (state.prefix is None) != (eviction is None):
            raise ValueError("an engine needs an eviction rule exactly when its state keeps a "
                             "prefix cache")
        if pipelined and (state.prefix is not None or not isinstance(runner, DispatchingRunner)):
            raise ValueError("a pipelined engine needs a runner that dispatches steps and no "
                             "prefix cache (which reads a step's tokens before the next plan)")
        self.state = state
        self.policy = policy
        self.runner = runner
        self.clock = clock
        self.eviction = eviction
        self._pipelined = pipelined
        self.stats = EngineStats()
        self._in_flight: tuple[Booked, PendingOutput] | None = None

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
        prompt: str | None = None, arrival_time: float | None = None,
        ttft_slo: float | None = None, tbt_slo: float | None = None,
        predicted_len: int = 0, predicted_dir: int = 0, conversation_id: str | None = None,
    ) -> Request:
        """The request, waiting. `predicted_len` / `predicted_dir`: an output-length
        prediction the caller already has and its expected error direction; without one,
        the state's prediction source is asked (see `RequestOptions` in
        `jserve.engine.admission`).
        `conversation_id`: the chat this turn belongs to, for the prefix cache."""
        now = self.clock() if arrival_time is None else arrival_time
        return self.state.add(request_id, prompt_token_ids, params, now, prompt=prompt,
                       ttft_slo=ttft_slo, tbt_slo=tbt_slo, predicted_len=predicted_len,
                       predicted_dir=predicted_dir, conversation_id=conversation_id)

    def abort(self, request_id: str) -> Request | None:
        """End a request early, with the sequences forked from it (`EngineState.abort`); a
        history it releases into a capped prefix cache is trimmed at once."""
        req = self.state.abort(request_id, self.clock())
        self._trim_to_capacity()
        return req

    @property
    def runner(self) -> Runner:
        return self._runner

    @runner.setter
    def runner(self, runner: Runner) -> None:
        """What the runner can do is read once here: a check against a runtime protocol
        walks its members, and the loop asks every step."""
        self._runner = runner
        self._dispatches = isinstance(runner, DispatchingRunner)
        self._repeats = isinstance(runner, RepeatingRunner)

    @property
    def pipelined(self) -> bool:
        """Whether steps are pipelined now: asked for, the runner in place dispatches (a
        wrapper that reads every step's output, such as a trace replay's, runs in step),
        and no live request decodes under a grammar (its next step's token mask follows
        from the token the step in flight has not returned yet)."""
        return self._pipelined and self._dispatches and not self.state.live.constrained

    @property
    def has_unfinished(self) -> bool:
        """Requests not ended, or a dispatched step whose tokens are not read yet."""
        return self.state.has_unfinished or self._in_flight is not None

    def step(self, until: float | None = None) -> list[Request]:
        """Run one iteration; returns the requests that produced a token (or finished).

        The iteration's plan is the policy's, or the next step of the last plan that
        repeats (`Plan.repeat`) where nothing has changed since (`EngineState.apply_repeat`).

        `until`: the time the next request arrives, where the caller knows it (a trace
        replay). Given it, a plan that repeats (`Plan.repeat`) on a runner that can run
        repeated decodes at once (the simulator's) runs its later steps in one go: those
        that start before `until`, up to the one that ends the first request by length.
        They are the steps, tokens and times that as many `step()`s would give; only the
        Python per step is saved. The serving loops never pass it (their arrivals are not
        known in advance) and so run one step per call.

        A step left in flight when the loop stops pipelining (a request with a grammar
        arrived) is read by a call of its own, which plans nothing."""
        gained = self._step(until)
        self._trim_to_capacity()
        return gained

    def _step(self, until: float | None) -> list[Request]:
        if self._in_flight is not None and not self.pipelined:
            return self._read_in_flight()
        now = self.clock()
        plan = self.state.apply_repeat(now) or self._plan(now)
        self.stats.num_preemptions += len(plan.preempt)
        batch = self.state.batch(with_inputs=self.runner.needs_inputs)
        self.stats.num_swaps += batch.num_swapped_out
        if batch.num_seqs == 0:
            if batch.updates_runner:
                self.runner.execute(batch)
            if (not plan.preempt and not plan.features and self.state.has_unfinished
                    and self._in_flight is None):
                raise PlanError(
                    f"policy {self.policy.name!r} scheduled nothing with {len(self.state.requests)} "
                    "requests unfinished: the engine would stall"
                )
            self.state.commit(batch, StepOutput.empty(), now)
            return self._read_in_flight()
        if self.pipelined:
            return self._pipeline(batch)
        out = self.runner.execute(batch)
        self.stats.num_steps += 1
        self.stats.num_batched_tokens += batch.num_tokens
        gained = self.state.commit(batch, out, self.clock())
        if plan.repeat > 1 and until is not None and self._repeats:
            return self._repeat(batch, plan.repeat - 1, until) or gained
        return gained

    def _plan(self, now: float) -> Plan:
        """The policy's plan for the state now, with the eviction rule's picks, applied."""
        view = self.state.snapshot(now)
        plan = self.policy.schedule(view)
        if self.eviction is not None:
            plan = self._with_evictions(plan, view.now)
        self.state.apply(plan, view.now)
        return plan

    def _pipeline(self, batch: Batch) -> list[Request]:
        """Dispatch `batch`, read the step before it while the device computes, book it."""
        pending = self.runner.dispatch(batch)
        self.stats.num_steps += 1
        self.stats.num_batched_tokens += batch.num_tokens
        gained = self._read_in_flight()
        self._in_flight = (self.state.book(batch, self.clock()), pending)
        return gained

    def _read_in_flight(self) -> list[Request]:
        if self._in_flight is None:
            return []
        (booked, pending), self._in_flight = self._in_flight, None
        return self.state.read(booked, pending.result(), self.clock())

    def _repeat(self, batch: Batch, wanted: int, until: float) -> list[Request]:
        steps = self.state.repeat_room(batch, wanted)
        if not steps:
            return []
        started = self.clock()
        done = self.runner.repeat_decodes(batch, steps, until)
        if not done.num_steps:
            return []
        self.stats.num_steps += done.num_steps
        self.stats.num_batched_tokens += batch.num_tokens * done.num_steps
        return self.state.commit_repeated(batch, done, started)

    def _trim_to_capacity(self) -> None:
        """Bring the prefix cache back within its capacity once a step or an abort has
        released histories into it: T-LRU's Algorithm 1 caches a served turn's history,
        then trims to the capacity, before the next turn is offered a hit."""
        if self.eviction is not None:
            evict = self._rule_picks(self.state.capacity_request(self.clock()))
            if evict:
                self.state.trim(evict)

    def _with_evictions(self, plan: Plan, now: float) -> Plan:
        evict = self._rule_picks(self.state.eviction_request(plan, now))
        if not evict:
            return plan
        # Evicting is the rule's choice step by step: such a step is never repeated.
        return dataclasses.replace(plan, evict=frozenset(evict), repeat=1)

    def _rule_picks(self, need: tuple[int, CacheSnapshot] | None) -> list[int]:
        """The blocks the eviction rule picks for what the state asks (none when nothing)."""
        if need is None:
            return []
        n, snapshot = need
        evict = self.eviction.evict(snapshot, n).tolist()
        self.stats.num_evicted_blocks += len(evict)
        return evict
