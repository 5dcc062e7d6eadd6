"""The built-in engine's admission gate on its own: readers, writers, pauses, sessions, aborts at the gate."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl_engine.gate import AdmissionGate, Ticket
from asyncrl_sglang.wire import PauseMode

WAIT_S = 5.0


async def _hold(gate: AdmissionGate, ticket: Ticket, release: asyncio.Event, log: list[str]) -> None:
    async with gate.admitted(ticket) as admitted:
        log.append("admitted" if admitted else "aborted")
        if admitted:
            await release.wait()


async def test_an_open_gate_admits_and_counts_in_flight_calls() -> None:
    gate = AdmissionGate()
    release, log = asyncio.Event(), list[str]()
    task = asyncio.create_task(_hold(gate, Ticket(2), release, log))
    await asyncio.sleep(0)
    assert log == ["admitted"]
    assert gate.num_in_flight == 1
    assert gate.num_waiting == 0
    release.set()
    await asyncio.wait_for(task, WAIT_S)
    assert gate.num_in_flight == 0


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
async def test_a_pause_holds_new_calls_until_resume(mode: PauseMode) -> None:
    gate = AdmissionGate()
    await gate.pause(mode)
    release, log = asyncio.Event(), list[str]()
    release.set()
    task = asyncio.create_task(_hold(gate, Ticket(3), release, log))
    await asyncio.sleep(0.01)
    assert log == []
    assert gate.num_waiting == 3
    assert gate.closed
    await gate.resume()
    await asyncio.wait_for(task, WAIT_S)
    assert log == ["admitted"]
    assert gate.num_waiting == 0
    assert not gate.closed


async def test_aborting_a_waiting_ticket_answers_it_without_admitting() -> None:
    gate = AdmissionGate()
    await gate.pause("abort")
    ticket, log = Ticket(1), list[str]()
    task = asyncio.create_task(_hold(gate, ticket, asyncio.Event(), log))
    await asyncio.sleep(0.01)
    await gate.abort_waiting([ticket])
    await asyncio.wait_for(task, WAIT_S)
    assert log == ["aborted"]
    assert gate.num_in_flight == 0
    assert gate.num_waiting == 0


async def test_a_writer_waits_for_in_flight_calls_and_holds_new_ones() -> None:
    gate = AdmissionGate()
    release, log = asyncio.Event(), list[str]()
    reader = asyncio.create_task(_hold(gate, Ticket(1), release, log))
    await asyncio.sleep(0)
    writer = asyncio.create_task(gate.acquire_writer())
    await asyncio.sleep(0.01)
    assert not writer.done(), "the writer must wait for the in-flight call"
    late = asyncio.create_task(_hold(gate, Ticket(1), asyncio.Event(), log))
    await asyncio.sleep(0.01)
    assert log == ["admitted"], "a call arriving while a writer waits is held"
    release.set()
    await asyncio.wait_for(asyncio.gather(reader, writer), WAIT_S)
    assert gate.num_in_flight == 0
    assert log == ["admitted"]
    await gate.release_writer()
    await asyncio.sleep(0.01)
    assert log == ["admitted", "admitted"]
    late.cancel()


async def test_an_update_takes_the_writer_side_only_outside_pauses_and_sessions() -> None:
    gate = AdmissionGate()
    async with gate.update():
        assert gate.closed
    assert not gate.closed
    await gate.pause("retract")
    async with gate.update():
        pass
    await gate.resume()
    assert not gate.closed


async def test_a_session_opened_outside_a_pause_holds_the_writer_side_until_closed() -> None:
    gate = AdmissionGate()
    assert await gate.open_session()
    assert not await gate.open_session(), "a second open changes nothing"
    assert gate.closed
    assert gate.session_open
    async with gate.update():  # the session already excludes generation: no second writer
        pass
    assert await gate.close_session()
    assert not gate.closed
    assert not await gate.close_session()


async def test_a_session_opened_inside_a_pause_does_not_hold_the_gate_after_resume() -> None:
    gate = AdmissionGate()
    await gate.pause("in_place")
    assert await gate.open_session()
    await gate.resume()
    assert not gate.closed
    assert await gate.close_session()
    assert not gate.closed
