"""The prompt ledger on its own: events, totals, its file round trip, and what the audit (and
`asyncrl-run --audit`) accepts and refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl_core.cli import EXIT_FAILED, EXIT_OK, main
from asyncrl_core.runner.ledger import (
    LEDGER_FILE,
    STALE,
    LedgerError,
    PromptLedger,
    audit,
    trained_by_step,
    write_json,
)


def _epoch_of_two(ledger: PromptLedger, epoch: int, first_group: int) -> None:
    """Prompts 0 and 1 of `epoch`, each issued and trained (at version `epoch`)."""
    for offset in range(2):
        ledger.issued(first_group + offset, (offset, epoch))
        ledger.trained(first_group + offset, epoch)


def test_events_count_per_prompt_and_round_trip() -> None:
    ledger = PromptLedger(dataset_size=2)
    ledger.issued(0, (0, 0))
    ledger.dropped(0, STALE)  # issued again under the same ticket
    ledger.issued(1, (0, 0))
    ledger.handed_back(1)
    ledger.issued(2, (0, 0))
    ledger.trained(2, 3)
    ledger.issued(3, (1, 0))
    ledger.dropped(3, "prompt too long")
    ledger.issued(4, (0, 1))  # open
    with pytest.raises(LedgerError, match="group 3 is not open"):
        ledger.trained(3, 4)
    with pytest.raises(LedgerError, match="needs a reason"):
        ledger.dropped(4, "")
    assert ledger.totals() == {
        "issued": 5,
        "trained": 1,
        "handed_back": 1,
        "dropped": 2,
        "dropped_stale": 1,
        "open": 1,
    }
    data = ledger.to_json(live_group_ids=[4], queued=[], epochs_issued=1)
    assert data["prompts"]["0"] == {"issued": 4, "trained": 1, "handed_back": 1, "dropped": {"stale": 1}}
    assert data["tickets"] == [[0, 0, [3], None], [0, 1, [], None], [1, 0, [], "prompt too long"]]
    again = PromptLedger.from_state(json.loads(json.dumps(data)))
    assert again.to_json(live_group_ids=[4], queued=[], epochs_issued=1) == data
    assert trained_by_step(data) == {4: [0]}
    assert [(r.epoch, r.trained, r.dropped, r.open, r.problems) for r in audit(data)] == [
        (0, 1, {"prompt too long": 1}, 0, []),
        (1, 0, {}, 1, []),
    ]
    with pytest.raises(LedgerError, match="not an asyncrl-ledger-1 ledger"):
        PromptLedger.from_state({**data, "format": "other"})


def test_the_audit_names_each_kind_of_fault() -> None:
    ledger = PromptLedger(dataset_size=3)
    _epoch_of_two(ledger, 0, 0)  # prompt 2 of epoch 0 never issued
    ledger.issued(5, (0, 0))
    ledger.trained(5, 1)  # prompt 0 of epoch 0 trained a second time
    ledger.issued(6, (1, 1))
    ledger.issued(7, (2, 1))  # open, but the buffer no longer holds it
    (first, second) = audit(ledger.to_json(live_group_ids=[6], queued=[], epochs_issued=1))
    assert first.problems == [
        "prompt 0 was trained 2 times (in steps 1, 2)",
        "1 of its prompts never issued: 2",
    ]
    assert second.problems == ["prompt 2 was issued and then lost (neither trained, dropped nor held)"]
    assert second.open == 1


def test_asyncrl_run_audit_exit_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ledger = PromptLedger(dataset_size=2)
    _epoch_of_two(ledger, 0, 0)
    ledger.issued(2, (1, 1))
    ledger.handed_back(2)  # queued for another issue: held by the run
    write_json(tmp_path / LEDGER_FILE, ledger.to_json(live_group_ids=[], queued=[(1, 1)], epochs_issued=1))
    assert main(["--audit", str(tmp_path)]) == EXIT_OK
    out = capsys.readouterr().out
    assert "epoch 0 (issued completely): ok: trained once 2, dropped none, open 0" in out
    assert "epoch 1 (partly issued): ok: trained once 0, dropped none, open 1" in out
    write_json(tmp_path / LEDGER_FILE, ledger.to_json(live_group_ids=[], queued=[], epochs_issued=1))
    assert main(["--audit", str(tmp_path)]) == EXIT_FAILED
    assert "FAILED" in capsys.readouterr().out
    assert main(["--audit", str(tmp_path / "absent")]) == EXIT_FAILED
    assert "cannot read" in capsys.readouterr().out
