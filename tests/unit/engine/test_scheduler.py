"""The scheduler as a state machine, without torch: the request table, the admission rules (FIFO, the prefill
budget, chunked prefill, the admission interval), the overlap scheduler's launch rule, and when a request
ends (EOS, stop ids, stop strings across tokens, lengths)."""

from __future__ import annotations

import subprocess
import sys

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from asyncrl_engine.options import SamplingOptions
from asyncrl_engine.request import Request
from asyncrl_engine.scheduler import Scheduler

EOS = 2


def request(rid: str, prompt_len: int, **options: object) -> Request:
    sampling = SamplingOptions(**options)  # type: ignore[arg-type]
    made = Request(rid=rid, prompt_ids=list(range(10, 10 + prompt_len)), options=sampling)
    made.version_marks = [("0", 0)]
    return made


def scheduler(**overrides: object) -> Scheduler:
    settings: dict[str, object] = {
        "max_running_requests": 4,
        "context_length": 64,
        "prefill_interval": 1,
        "chunked_prefill_size": 16,
        "eos_token_ids": frozenset({EOS}),
    }
    settings.update(overrides)
    return Scheduler(**settings)  # type: ignore[arg-type]


def test_the_scheduler_imports_no_torch() -> None:
    code = (
        "import sys; import asyncrl_engine.scheduler, asyncrl_engine.request, asyncrl_engine.options; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr


def test_admission_is_fifo_within_the_prefill_budget_and_a_longer_request_is_chunked() -> None:
    s = scheduler()
    first, second, long, last = request("a", 6), request("b", 6), request("c", 40), request("d", 1)
    for r in (first, second, long, last):
        s.table.add(r)
    assert s.admission_due()
    admitted = s.take_admitted(free=4)
    # 12 of the 16 tokens go to the first two; the long one starts its chunks with the 4 left.
    assert admitted == [first, second]
    assert s.table.chunked is long
    assert (s.table.chunk_next, s.table.chunk_prefilled) == (4, 0)
    assert list(s.table.waiting) == [last]
    assert s.admission_cut_short  # a slot was free for `last`, the budget was not
    # Chunks of a whole budget while more than a budget is left, then its last chunk is admitted.
    s.table.running.extend(admitted)
    s.table.chunk_prefilled = 4
    assert s.take_admitted(free=2) == []
    assert s.table.chunk_next == 16
    s.table.chunk_prefilled = 36
    assert s.take_admitted(free=2) == [long, last]
    assert s.table.chunked is long  # until the prefill of its last chunk puts it into the batch
    assert not s.table.waiting


def test_without_chunking_a_longer_request_joins_alone() -> None:
    s = scheduler(chunked_prefill_size=0)
    assert s.chunked_prefill_size is None
    short, long = request("a", 6), request("b", 9000)
    s.table.add(short)
    s.table.add(long)
    assert s.take_admitted(free=4) == [short]
    assert s.take_admitted(free=4) == [long]


def test_admissions_wait_for_the_interval_unless_the_queue_is_long() -> None:
    s = scheduler(prefill_interval=4, max_running_requests=8)
    s.table.running.append(request("running", 4))
    s.table.add(request("a", 4))
    assert not s.admission_due()
    s.steps_since_prefill = 3
    assert s.admission_due()
    s.steps_since_prefill = 0
    s.table.add(request("b", 4))
    assert s.admission_due()  # a quarter of the slots' worth is waiting


def test_simple_admissions_stop_before_a_request_that_needs_the_host() -> None:
    s = scheduler()
    plain, scoring = request("a", 4), request("b", 4, max_new_tokens=0)
    s.table.add(plain)
    s.table.add(scoring)
    assert s.take_admitted(free=4, simple_only=True) == [plain]
    assert list(s.table.waiting) == [scoring]


def test_the_next_decode_launches_early_only_while_the_batch_goes_on_unchanged() -> None:
    s = scheduler(max_running_requests=4)
    rows = [request(str(i), 4, max_new_tokens=8) for i in range(4)]
    for r in rows:
        r.output_ids.append(7)
    s.table.running.extend(rows)
    positions = s.decode_positions(pending=1)
    assert positions == [5, 5, 5, 5]
    assert s.continues(rows, positions, kv_capacity=64)
    assert not s.continues(rows, positions, kv_capacity=6)  # the cache must grow first
    assert not s.continues(rows[:3], positions, kv_capacity=64)  # the batch changed since the launch
    rows[0].finish_reason = {"type": "length", "length": 1}
    assert not s.continues(rows, s.decode_positions(pending=1), kv_capacity=64)  # a quarter finished
    rows[0].finish_reason = None
    for r in rows:
        r.output_ids.extend([7] * 6)  # 7 tokens: the step in flight's is the 8th and last of each
    assert not s.continues(rows, s.decode_positions(pending=1), kv_capacity=64)


def test_a_request_ends_at_eos_a_stop_id_or_its_length_and_not_before_min_new_tokens() -> None:
    s = scheduler()
    r = request("a", 4, max_new_tokens=5, min_new_tokens=2, stop_token_ids=frozenset({9}))
    r.output_ids.append(EOS)
    assert s.finish_reason(r, EOS) is None  # before min_new_tokens
    r.output_ids.append(9)
    assert s.finish_reason(r, 9) == {"type": "stop", "matched": 9}
    r.output_ids.extend([5, 5, 5])
    assert s.finish_reason(r, 5) == {"type": "length", "length": 5}
    ignoring = request("b", 4, ignore_eos=True)
    ignoring.output_ids.append(EOS)
    assert s.finish_reason(ignoring, EOS) is None
    near_the_end = request("c", 62, max_new_tokens=None)
    near_the_end.output_ids.extend([5, 5])
    assert s.finish_reason(near_the_end, 5) == {"type": "length", "length": 2}


def test_a_stop_string_is_found_across_tokens() -> None:
    texts = {20: "Hel", 21: "lo", 22: " wor", 23: "ld", 24: "!"}
    s = scheduler(decode_text=lambda ids: "".join(texts[i] for i in ids))
    r = request("a", 4, max_new_tokens=10, stop=("world", "lo w"))
    found: list[object] = []
    for token in (20, 21, 22, 23):
        r.output_ids.append(token)
        found.append(s.finish_reason(r, token))
    # "lo w" completes at the third token, before "world" (which ends later in the text).
    assert found == [None, None, {"type": "stop", "matched": "lo w"}, {"type": "stop", "matched": "world"}]


def test_a_relabel_marks_every_live_request() -> None:
    s = scheduler()
    running, waiting = request("a", 4), request("b", 4)
    running.output_ids.extend([5, 5])
    s.table.running.append(running)
    s.table.add(waiting)
    s.table.relabel("1")
    assert running.version_marks == [("0", 0), ("1", 2)]
    assert waiting.version_marks == [("1", 0)]
    # Back to the previous version with no token in between: the spans merge again.
    s.table.relabel("0")
    assert running.version_marks == [("0", 0)]
    assert waiting.version_marks == [("0", 0)]


class SchedulerMachine(RuleBasedStateMachine):
    """Requests arrive, steps admit them (and prefill the chunked one's next chunk) as the batch does, and
    running requests finish in any order; after every rule the table holds each live request in exactly one
    place, the chunked request's slot stays free, and every admission was FIFO within the free slots and the
    prefill budget."""

    def __init__(self) -> None:
        super().__init__()
        self.s = scheduler(max_running_requests=4, context_length=4096, chunked_prefill_size=16)
        self.live: list[Request] = []
        self.arrivals = 0

    @rule(prompt_len=st.integers(1, 40))
    def arrive(self, prompt_len: int) -> None:
        made = request(f"r{self.arrivals}", prompt_len)
        self.arrivals += 1
        self.s.table.add(made)
        self.live.append(made)

    @rule()
    def step(self) -> None:
        s, table = self.s, self.s.table
        queued = list(table.waiting)
        due = s.admission_due()
        s.steps_since_prefill = 0 if due else s.steps_since_prefill + 1
        free = s.max_running_requests - len(table.running)
        chunked_before = table.chunked
        admitted = s.take_admitted(free) if due else []
        assert len(admitted) <= free
        fresh = [r for r in admitted if r is not chunked_before]
        assert fresh == queued[: len(fresh)]  # FIFO
        if chunked_before is not None and chunked_before in admitted:
            computed = chunked_before.num_tokens - table.chunk_prefilled
        else:
            computed = 0
        computed += sum(r.num_tokens for r in fresh)
        assert computed + table.chunk_next <= 16  # the prefill budget, the next chunk included
        if table.chunked in admitted:  # its last chunk: it joins the batch
            table.chunked = None
        table.running.extend(admitted)
        for r in admitted:
            r.was_running = True
        if table.chunk_next:
            assert table.chunked is not None
            table.chunk_prefilled = min(
                table.chunk_prefilled + table.chunk_next, table.chunked.num_tokens - 1
            )
            table.chunk_next = 0

    @precondition(lambda self: bool(self.s.table.running))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        table = self.s.table
        slot = data.draw(st.integers(0, len(table.running) - 1))
        done = table.running[slot]
        table.forget(done)
        table.remove_slot(slot)
        self.live.remove(done)

    @invariant()
    def each_live_request_is_in_one_place(self) -> None:
        table = self.s.table
        places = [*table.running, *table.chunked_list(), *table.waiting]
        assert sorted(id(r) for r in places) == sorted(id(r) for r in self.live)
        assert set(table.by_rid) == {r.rid for r in self.live}
        assert len(table.running) <= self.s.max_running_requests
        if table.chunked is not None:  # its slot, the last one, stays free
            assert len(table.running) < self.s.max_running_requests


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
