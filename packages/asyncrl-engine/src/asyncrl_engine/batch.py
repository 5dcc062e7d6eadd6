"""The running batch, driven one step at a time by the overlap scheduler (see `engine.py`'s docstring).

`Batch.step` is one iteration of the engine's loop: it launches decode steps and reads them one step late
while the rules allow (`Scheduler.continues`), admits waiting requests beside the step in flight where none
needs the host first (`admit_beside`), and otherwise syncs: reads the step in flight and frees the slots of
the requests that finished meanwhile, before the batch changes. Recording a step's tokens (`record`) appends
them, finishes who is done and tells the clients; `recover` isolates the request that made a step fail.
The scheduler decides, the step runner computes, and this module keeps the two in step.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from asyncrl_engine.request import INTERNAL_ERROR, Request
from asyncrl_engine.sampling import SampledToken
from asyncrl_engine.scheduler import Scheduler
from asyncrl_engine.snapshot import EngineCounters
from asyncrl_engine.step_runner import LaunchedStep, StepRunner

logger = logging.getLogger(__name__)


class Batch:
    """The steps of one engine's requests (see the module's docstring). `publish` swaps in the engine's
    snapshot: called before any client hears of a change that the snapshot shows (a request running, a
    request finished)."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: StepRunner,
        counters: EngineCounters,
        publish: Callable[[], None],
        *,
        overlap_schedule: bool,
    ) -> None:
        self.scheduler = scheduler
        self.table = scheduler.table
        self.runner = runner
        self.counters = counters
        self.publish = publish
        self.overlap_schedule = overlap_schedule
        """Launch each decode step before reading the previous one's tokens."""
        self.in_flight: LaunchedStep | None = None
        """The decode step launched and not read yet (overlap scheduler only)."""
        self.step_requests: list[Request] = []
        """The requests of the step in progress (admitted and running), for `recover`."""
        self._last_decode_end = 0.0
        self.throughput_window: deque[tuple[float, int]] = deque(maxlen=32)

    # ---------------------------------------------------------------------------------------------- a step
    def step(self) -> None:
        """One step of the running batch (the loop calls it while there is work and no pause)."""
        scheduler, table = self.scheduler, self.table
        self.step_requests = list(table.running)
        in_flight = self.in_flight
        if in_flight is not None:
            positions = scheduler.decode_positions(pending=1)
            cache = self.runner.cache
            if scheduler.continues(in_flight.requests, positions, 0 if cache is None else cache.capacity):
                # Overlapped: launch the next step from this one's ids on the device, then read this one
                # while the device runs the next.
                scheduler.steps_since_prefill += 1
                self.in_flight = self.runner.launch_decode(in_flight, positions)
                self.complete(in_flight)
                return
            if self.admit_beside(in_flight):
                return
            # A sync point: read the step in flight and free the finished slots before the batch changes.
            self.in_flight = None
            self.complete(in_flight)
            self.release_finished()
        due = scheduler.admission_due()
        scheduler.steps_since_prefill = 0 if due else scheduler.steps_since_prefill + 1
        free = scheduler.max_running_requests - len(table.running)
        admitted = scheduler.take_admitted(free) if due else []
        self.step_requests = [*admitted, *table.running]
        if admitted or table.chunk_next:
            began = time.perf_counter()
            if admitted:
                self.prefill(admitted)
            if table.chunk_next:
                self.prefill_chunk()
            self.counters.prefill_busy_us += round((time.perf_counter() - began) * 1e6)
        if table.running:
            if self.overlap_schedule:
                self.in_flight = self.runner.launch_decode(None)
            else:
                self.decode()

    def drain(self) -> None:
        """Read the decode step in flight, if any, and free the slots of the requests finished since it was
        launched: afterwards the engine is as the non-overlapped loop leaves it between two steps."""
        step = self.in_flight
        if step is None:
            return
        self.in_flight = None
        self.step_requests = list(self.table.running)
        try:
            self.complete(step)
            self.release_finished()
        except Exception as error:
            self.recover(error)
        self.step_requests = []

    def admit_beside(self, step: LaunchedStep) -> bool:
        """Admit waiting requests without reading the decode step in flight, if nothing needs the host first;
        False (nothing done) otherwise, and the caller syncs.

        The admitted requests are prefilled into the slots of finished rows (the step in flight decodes them
        for nothing, and the device runs the prefill after it) and then into fresh slots after the running
        ones, their first tokens drawn on the device. The next decode step is launched from the step in
        flight's ids with those first tokens put in place on the device, so no read of the host sits
        between the launches. Then the step in flight is read and recorded, then the first tokens, in the
        order the sync path records them. Needs: the batch unchanged since the launch, an admission due, a
        finished row or a free slot, and the KV cache already long enough for the prefill and the next step
        (growing it would copy what the step in flight is still writing)."""
        scheduler, table = self.scheduler, self.table
        running = table.running
        if running != step.requests or table.chunked is not None or not scheduler.admission_due():
            return False
        reusable = [slot for slot, r in enumerate(running) if r.finished]
        free = len(reusable) + scheduler.max_running_requests - len(running)
        cache = self.runner.cache
        if cache is None or free == 0:
            return False
        positions = scheduler.decode_positions(pending=1)
        cut_short = scheduler.admission_cut_short
        admitted = scheduler.take_admitted(free, simple_only=True)
        needed = max([*positions, *(r.num_tokens for r in admitted)], default=0) + 2
        if not admitted or cache.capacity < min(needed, scheduler.context_length):
            # Undone: the queue and whether an admission is due are as before, for the sync path.
            for request in reversed(admitted):
                table.waiting.appendleft(request)
            scheduler.admission_cut_short = cut_short
            return False
        slots = (reusable + list(range(len(running), scheduler.max_running_requests)))[: len(admitted)]
        scheduler.steps_since_prefill = 0
        self.step_requests = [*admitted, *running]
        began = time.perf_counter()
        first = self.prefill(admitted, read=False, slots=slots)
        self.counters.prefill_busy_us += round((time.perf_counter() - began) * 1e6)
        assert first is not None
        # Each row's input: the step in flight's token, or the first token of the request admitted there.
        num_reused = min(len(reusable), len(admitted))
        input_ids = step.tokens
        if num_reused:
            rows = torch.tensor(slots[:num_reused]).to(input_ids.device, non_blocking=True)
            input_ids = input_ids.index_copy(0, rows, first.tokens[:num_reused])
        if num_reused < len(admitted):
            input_ids = torch.cat([input_ids, first.tokens[num_reused:]])
        self.in_flight = self.runner.launch_decode(step, scheduler.decode_positions(pending=1), input_ids)
        self.complete(step)
        self.publish()  # the admitted requests run before their clients hear of them
        self.record(first.requests, first.read())
        return True

    # ---------------------------------------------------------------------------------------------- prefill
    def prefill(
        self, requests: list[Request], read: bool = True, slots: list[int] | None = None
    ) -> LaunchedStep | None:
        """Prefill `requests` into their slots (`StepRunner.prefill`), put them into the batch, and sample
        each one's next token. `slots`: where each request runs (a finished request's slot it takes over,
        or the next ones after the running requests, in order; default: the next ones). `read=False`
        (requests that all sample and read no prompt logprobs): the draws are returned, launched and not
        read, instead of recorded."""
        table = self.table
        if slots is None:
            slots = list(range(len(table.running), len(table.running) + len(requests)))
        last_hidden = self.runner.prefill(requests, slots)
        if table.chunked in requests:  # its last chunk: it joins the batch
            table.chunked = None
        table.place(requests, slots)
        # max_new_tokens 0 is prefill only (scoring callers read the input logprobs): nothing is sampled.
        sampling_rows = [row for row, r in enumerate(requests) if r.options.max_new_tokens != 0]
        for request in requests:
            if request.options.max_new_tokens == 0:
                self.finish(request, {"type": "length", "length": 0})
        if len(sampling_rows) < len(requests):
            if not sampling_rows:
                return None
            last_hidden = last_hidden[torch.tensor(sampling_rows, device=last_hidden.device)]
            requests = [requests[row] for row in sampling_rows]
        if not read:
            return self.runner.launch_sample(requests, last_hidden)
        sampled = self.runner.sample(requests, last_hidden)
        # Published before any client hears of these requests: one told of a token sees its request running.
        # (A decode step's requests were running at the last publication, at the end of the loop before.)
        self.publish()
        self.record(requests, sampled)
        return None

    def prefill_chunk(self) -> None:
        """Prefill the next chunk of the request prefilled in chunks (planned by the scheduler)."""
        table = self.table
        request, size = table.chunked, table.chunk_next
        table.chunk_next = 0
        if request is None:  # aborted since its chunk was planned (by a callback of this step)
            return
        table.chunk_prefilled = self.runner.prefill_chunk(request, size)

    def prefill_alone(self, request: Request) -> None:
        """Prefill one request into slot 0 (nothing running) and sample its next token, in chunks if it is
        longer than `chunked_prefill_size` (the probes of `recover`)."""
        table = self.table
        size = self.scheduler.chunked_prefill_size
        if size is not None and request.num_tokens > size:
            table.chunked, table.chunk_prefilled = request, 0
            while request.num_tokens - table.chunk_prefilled > size:
                table.chunk_next = size
                self.prefill_chunk()
        self.prefill([request])

    def drop_chunked(self, store: bool) -> None:
        """End the chunked prefill of `chunked` (retracted, aborted): with `store`, the KV of its chunks goes
        into the prefix cache; its prompt logprobs so far are dropped (recomputed at its next prefill)."""
        table = self.table
        request = table.chunked
        assert request is not None
        if store and table.chunk_prefilled:
            self.runner.store_prefix(request, table.chunk_slot, table.chunk_prefilled)
        request.input_logprobs.clear()
        request.input_top_logprobs.clear()
        table.chunked = None
        table.chunk_prefilled = table.chunk_next = 0

    # ---------------------------------------------------------------------------------------------- decode
    def decode(self) -> None:
        """One decode step, read at once (the non-overlapped loop, and the probes of `recover`)."""
        self.complete(self.runner.launch_decode(None))

    def complete(self, step: LaunchedStep) -> None:
        """Read a launched step's tokens (waiting for that step only) and record them. A request finished
        since the launch gets nothing: the token computed after its finish is dropped."""
        recorded = self.record(step.requests, step.read())
        ended = time.monotonic()
        # Launches overlap: a step's time is from its launch or the previous step's end, whichever is later.
        self.throughput_window.append((ended - max(step.launched_s, self._last_decode_end), recorded))
        self._last_decode_end = ended
        elapsed = sum(s for s, _ in self.throughput_window)
        if elapsed > 0:
            self.counters.gen_throughput = sum(n for _, n in self.throughput_window) / elapsed

    def release_finished(self) -> None:
        """Free the slots of finished requests that a step in flight still decoded (their prefixes were
        cached when they finished)."""
        running = self.table.running
        for slot in reversed(range(len(running))):
            if running[slot].finished:
                self.free_slot(slot)

    def free_slot(self, slot: int) -> None:
        """Remove the running request in `slot`, moving the last running request's KV into its place."""
        running = self.table.running
        last = len(running) - 1
        if slot != last:
            # Up to num_tokens: covers the KV written by this step's decode even before its token is appended.
            self.runner.move_slot(last, slot, running[last].num_tokens)
        self.table.remove_slot(slot)

    # ---------------------------------------------------------------------------------------------- outputs
    def record(self, requests: list[Request], sampled: list[SampledToken]) -> int:
        """Append each unfinished request's token and finish who is done, then publish once (if any
        finished) and tell the clients, in row order; returns how many tokens were appended. A request
        finished since its token was drawn (a step in flight decoded it once more) gets nothing: that token is
        dropped. A callback that finishes another request of the step (an abort) finishes it with the tokens
        it has: it is told of its finish, not of its token."""
        told: list[tuple[Request, bool]] = []
        recorded = 0
        finish_reason = self.scheduler.finish_reason
        for request, (token, logprob, top) in zip(requests, sampled, strict=True):
            if request.finish_reason is not None:
                continue
            recorded += 1
            request.output_ids.append(token)
            if request.return_logprob:
                request.output_logprobs.append(logprob)
                if request.top_logprobs_num > 0:
                    request.output_top_logprobs.append(top)
            reason = finish_reason(request, token)
            if reason is not None:
                self.end(request, reason)
                told.append((request, True))
            elif request.stream:
                told.append((request, False))
        self.counters.generation_tokens_total += recorded
        if told:
            if any(finished for _, finished in told):
                # Before any client hears: one told that its request finished never reads a snapshot where
                # it runs.
                self.publish()
            for request, finished in told:
                if finished or request.finish_reason is None:
                    self.notify(request, finished)
        return recorded

    def finish(self, request: Request, reason: dict[str, Any]) -> None:
        """End `request` (`end`), publish, then tell its client."""
        self.end(request, reason)
        self.publish()  # a client told that its request finished never reads a snapshot where it runs
        self.notify(request, True)

    def end(self, request: Request, reason: dict[str, Any]) -> None:
        """Set `request`'s finish reason and take it out of the batch or the queue (its prefix cached); its
        client is not told yet."""
        table = self.table
        request.finish_reason = reason
        table.forget(request)
        if request in table.running:
            slot = table.running.index(request)
            self.runner.store_prefix(request, slot)
            if self.in_flight is None:
                self.free_slot(slot)
            # Else the step in flight decodes this slot: it is freed once that step is read.
        elif request is table.chunked:
            self.drop_chunked(store=request.kv_weights_epoch == self.runner.weights_epoch)
        elif request in table.waiting:
            table.waiting.remove(request)

    def abort(self, request: Request, message: str, status_code: int | None = None) -> None:
        """Finish `request` as aborted: status None for a user's abort (answered with its partial output),
        500 for a failure of the engine itself (answered as an error, see `calls.error_abort`)."""
        self.counters.num_aborted_requests_total += 1
        reason = {"type": "abort", "message": message, "status_code": status_code, "err_type": None}
        self.finish(request, reason)

    def notify(self, request: Request, finished: bool) -> None:
        """Call the request's `on_update`; one that raises ends its own request (it can no longer be told)."""
        if request.on_update is None:
            return
        try:
            request.on_update(request, finished)
        except Exception as error:
            logger.exception("the update callback of request %s failed", request.rid)
            if not finished and not request.finished:
                self.abort(
                    request, f"Internal engine error: the update callback failed: {error}", INTERNAL_ERROR
                )

    # ---------------------------------------------------------------------------------------------- failures
    def recover(self, error: Exception) -> None:
        """After a step raised: find which of its requests cannot proceed and finish only those.

        Every unfinished request of the step leaves the batch (its KV is recomputed later, as after a retract)
        and runs alone: a prefill of its prompt and output so far, then one decode step. One that raises alone
        is finished with the error; the others go back to the front of the queue in their order, with the
        tokens they had (and any the probe produced). A failure that no request reproduces alone costs the
        step's requests a re-prefill, never their output."""
        table = self.table
        # A step in flight when the failure came is dropped with its tokens (no client heard of them).
        self.in_flight = None
        involved = [r for r in self.step_requests if not r.finished]
        chunked = table.chunked
        if chunked is not None:
            # Its KV is dropped and it is probed as the others (its chunks may be what failed).
            table.chunked = None
            if chunked not in involved:
                involved.append(chunked)
        logger.exception("engine step failed for %d requests; retrying them one by one", len(involved))
        # Every running request belongs to the step (a finished one the failure left in place included).
        table.running.clear()
        for request in involved:
            if not request.was_running:
                # Prompt logprobs are computed once, at the first prefill: drop any half-written ones.
                request.input_logprobs.clear()
                request.input_top_logprobs.clear()
        survivors: list[Request] = []
        for request in involved:
            if request.finished:
                continue
            table.running.clear()
            try:
                self.prefill_alone(request)
                if table.running:
                    self.decode()
            except Exception as probe_error:
                table.running.clear()
                table.chunked = None
                if not request.finished:
                    logger.exception("request %s fails alone: finished with the error", request.rid)
                    self.abort(request, f"Internal engine error: {probe_error}", INTERNAL_ERROR)
                continue
            if not request.finished:
                self.runner.store_prefix(request, 0)  # its re-prefill then copies what the probe computed
                table.running.clear()
                survivors.append(request)
        for request in reversed(survivors):
            table.waiting.appendleft(request)
        if survivors and len(survivors) == len(involved):
            logger.warning("no request of the failed step fails alone (%s): all requeued", error)
