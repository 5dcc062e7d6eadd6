"""The per-prompt ledger: where every issued prompt went, across restarts, and its audit.

Each issue of a prompt belongs to a ticket `(prompt_index, epoch)` (`asyncrl_core.runner.dataloader`): the
epoch whose order issued it first. A ticket ends *trained* (handed to the actor) or *dropped* with a reason
(a permanent failure, such as a prompt too long for the context); on the way it may be handed back (a
retryable failure, or a restart that found it in flight) or dropped as stale (`stale`), and is then issued
again under the same ticket. Per prompt the ledger counts issues, trainings, hand-backs and drops by reason.

The buffer worker keeps the ledger; checkpoints save it and a resumed run continues it, so it covers the
whole run. `ledger.json` in the run folder (written at each checkpoint and at the end) holds it with the
tickets still open, read from the buffer and the dataloader themselves, not from the ledger; `audit` (and
`asyncrl-run --audit RUN_DIR`) checks from it that every prompt of each epoch whose order was issued
completely was trained exactly once or dropped with a reason, or is still open and held by the run.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from asyncrl_core.runner.atomic import atomic_write_bytes
from asyncrl_core.runner.dataloader import Ticket

LEDGER_FILE = "ledger.json"
LEDGER_FORMAT = "asyncrl-ledger-1"
STALE = "stale"
"""The drop reason of a group older than `agentloop.max_actor_accept_staleness` (its prompt is issued
again)."""


class LedgerError(ValueError):
    """A ledger event that contradicts the ledger (a group it never issued), or an unreadable ledger file."""


@dataclass(slots=True)
class PromptRecord:
    """What happened to one prompt over the whole run."""

    issued: int = 0
    trained: int = 0
    handed_back: int = 0
    """Issued again after a retryable failure or a restart that found it in flight."""
    dropped: dict[str, int] = field(default_factory=dict[str, int])
    """Drops by reason: `stale` (issued again), or a permanent failure's reason (not issued again)."""


@dataclass(slots=True)
class TicketRecord:
    """The outcome of one ticket: its trainings (one when all is well) and its permanent drop reason."""

    trained_at: list[int] = field(default_factory=list[int])
    """The actor version each training of the ticket started from (the number of steps before it)."""
    dropped: str | None = None

    @property
    def trained(self) -> int:
        return len(self.trained_at)


class PromptLedger:
    """Per-prompt and per-ticket accounting of one run. Not thread-safe: `BufferWorker` serialises it."""

    def __init__(self, dataset_size: int) -> None:
        self.dataset_size = dataset_size
        self.prompts: dict[int, PromptRecord] = {}
        self.tickets: dict[Ticket, TicketRecord] = {}
        self.open_groups: dict[int, Ticket] = {}
        """Groups issued and neither trained, dropped nor handed back: group id -> ticket."""

    # --- events -------------------------------------------------------------------------------------------

    def issued(self, group_id: int, ticket: Ticket) -> None:
        self._prompt(ticket[0]).issued += 1
        self.tickets.setdefault(ticket, TicketRecord())
        self.open_groups[group_id] = ticket

    def trained(self, group_id: int, actor_version: int) -> Ticket:
        """The group was handed to the actor training from `actor_version` (in step `actor_version + 1`)."""
        ticket = self._close(group_id)
        self._prompt(ticket[0]).trained += 1
        self.tickets[ticket].trained_at.append(actor_version)
        return ticket

    def handed_back(self, group_id: int) -> Ticket:
        """The group failed in a way worth retrying: its ticket is issued again."""
        ticket = self._close(group_id)
        self._prompt(ticket[0]).handed_back += 1
        return ticket

    def dropped(self, group_id: int, reason: str) -> Ticket:
        """The group was dropped for `reason`; its ticket ends there unless the reason is `STALE`."""
        if not reason:
            raise LedgerError("a drop needs a reason")
        ticket = self._close(group_id)
        record = self._prompt(ticket[0])
        record.dropped[reason] = record.dropped.get(reason, 0) + 1
        if reason != STALE:
            self.tickets[ticket].dropped = reason
        return ticket

    def skipped(self, ticket: Ticket, reason: str) -> None:
        """A prompt dropped for good earlier (`reason`) comes up again in a later epoch: it is not issued,
        and its ticket ends there, dropped for the same reason (so the epoch's audit accounts for it)."""
        if not reason or reason == STALE:
            raise LedgerError("a skipped prompt needs the reason it was dropped for good")
        self.tickets[ticket] = TicketRecord(dropped=reason)

    def _close(self, group_id: int) -> Ticket:
        ticket = self.open_groups.pop(group_id, None)
        if ticket is None:
            raise LedgerError(f"group {group_id} is not open in the ledger")
        return ticket

    def _prompt(self, prompt_index: int) -> PromptRecord:
        record = self.prompts.get(prompt_index)
        if record is None:
            record = self.prompts[prompt_index] = PromptRecord()
        return record

    # --- totals and files ---------------------------------------------------------------------------------

    def totals(self) -> dict[str, int]:
        """Sums over prompts: `issued = trained + handed_back + dropped + open`."""
        records = self.prompts.values()
        return {
            "issued": sum(r.issued for r in records),
            "trained": sum(r.trained for r in records),
            "handed_back": sum(r.handed_back for r in records),
            "dropped": sum(sum(r.dropped.values()) for r in records),
            "dropped_stale": sum(r.dropped.get(STALE, 0) for r in records),
            "open": len(self.open_groups),
        }

    def to_json(
        self, *, live_group_ids: Iterable[int], queued: Iterable[Ticket], epochs_issued: int
    ) -> dict[str, Any]:
        """The ledger as `ledger.json` holds it. `live_group_ids` are the groups the buffer holds (in flight
        or buffered), `queued` the tickets the dataloader will issue again, `epochs_issued` the epochs whose
        order was issued completely: an open group the buffer does not hold is left out, so that the audit
        reports its ticket as lost."""
        live = set(live_group_ids)
        return {
            "format": LEDGER_FORMAT,
            "dataset_size": self.dataset_size,
            "epochs_issued": epochs_issued,
            "totals": self.totals(),
            "prompts": {
                str(index): {
                    "issued": r.issued,
                    "trained": r.trained,
                    "handed_back": r.handed_back,
                    "dropped": dict(sorted(r.dropped.items())),
                }
                for index, r in sorted(self.prompts.items())
            },
            "tickets": [[p, e, t.trained_at, t.dropped] for (p, e), t in sorted(self.tickets.items())],
            "open_groups": [[g, p, e] for g, (p, e) in sorted(self.open_groups.items()) if g in live],
            "queued": [[p, e] for p, e in queued],
        }

    @classmethod
    def from_state(cls, data: Mapping[str, Any]) -> PromptLedger:
        """The ledger `to_json` wrote. Raises `LedgerError` for another format or a malformed one."""
        if data.get("format") != LEDGER_FORMAT:
            raise LedgerError(f"not an {LEDGER_FORMAT} ledger (format {data.get('format')!r})")
        try:
            ledger = cls(int(data["dataset_size"]))
            for index, record in cast("dict[str, dict[str, Any]]", data["prompts"]).items():
                ledger.prompts[int(index)] = PromptRecord(
                    int(record["issued"]),
                    int(record["trained"]),
                    int(record["handed_back"]),
                    {str(k): int(v) for k, v in cast("dict[str, Any]", record["dropped"]).items()},
                )
            for prompt, epoch, trained_at, dropped in data["tickets"]:
                record = TicketRecord([int(version) for version in trained_at], dropped)
                ledger.tickets[(int(prompt), int(epoch))] = record
            for group_id, prompt, epoch in data["open_groups"]:
                ledger.open_groups[int(group_id)] = (int(prompt), int(epoch))
        except (KeyError, TypeError, ValueError) as error:
            raise LedgerError(f"malformed ledger: {error!r}") from error
        return ledger


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write `data` to `path` through a temporary file renamed into place (a reader never sees half)."""
    atomic_write_bytes(path, (json.dumps(data, indent=1) + "\n").encode())


# --- audit --------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class EpochAudit:
    """One epoch's tickets by outcome."""

    epoch: int
    complete: bool
    """The epoch's order was issued completely (so every prompt of the dataset must have a ticket)."""
    trained: int = 0
    dropped: dict[str, int] = field(default_factory=dict[str, int])
    open: int = 0
    problems: list[str] = field(default_factory=list[str])


def audit(data: Mapping[str, Any]) -> list[EpochAudit]:
    """Check a `ledger.json`: per epoch, every ticket trained exactly once, dropped with a reason, or open
    and held by the run (in the buffer, or queued for another issue); in an epoch whose order was issued
    completely, every prompt of the dataset has a ticket. Problems are listed per epoch."""
    ledger = PromptLedger.from_state(data)
    epochs_issued = int(data["epochs_issued"])
    held = {(int(p), int(e)) for _, p, e in data["open_groups"]} | {
        (int(p), int(e)) for p, e in data["queued"]
    }
    epochs: dict[int, EpochAudit] = {
        epoch: EpochAudit(epoch, complete=epoch < epochs_issued) for epoch in range(epochs_issued)
    }
    for (prompt, epoch), record in sorted(ledger.tickets.items()):
        report = epochs.setdefault(epoch, EpochAudit(epoch, complete=epoch < epochs_issued))
        ticket = f"prompt {prompt}"
        if record.trained > 1:
            steps = ", ".join(str(version + 1) for version in record.trained_at)
            report.problems.append(f"{ticket} was trained {record.trained} times (in steps {steps})")
        elif record.trained == 1 and record.dropped is not None:
            report.problems.append(f"{ticket} was trained and dropped ({record.dropped})")
        elif record.trained == 1:
            report.trained += 1
        elif record.dropped is not None:
            report.dropped[record.dropped] = report.dropped.get(record.dropped, 0) + 1
        elif (prompt, epoch) in held:
            report.open += 1
        else:
            report.problems.append(f"{ticket} was issued and then lost (neither trained, dropped nor held)")
    for report in epochs.values():
        if report.complete:
            missing = [p for p in range(ledger.dataset_size) if (p, report.epoch) not in ledger.tickets]
            if missing:
                shown = ", ".join(str(p) for p in missing[:10]) + (" ..." if len(missing) > 10 else "")
                report.problems.append(f"{len(missing)} of its prompts never issued: {shown}")
    return [epochs[epoch] for epoch in sorted(epochs)]


def trained_by_step(data: Mapping[str, Any]) -> dict[int, list[int]]:
    """The prompts trained in each step (1-based) of a `ledger.json`, sorted."""
    steps: dict[int, list[int]] = {}
    for prompt, _, trained_at, _ in data["tickets"]:
        for version in trained_at:
            steps.setdefault(int(version) + 1, []).append(int(prompt))
    return {step: sorted(prompts) for step, prompts in sorted(steps.items())}


def audit_run(run_dir: Path) -> tuple[bool, list[str]]:
    """`asyncrl-run --audit`: whether the run folder's ledger is sound, and the lines that say so."""
    path = Path(run_dir) / LEDGER_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return False, [f"cannot read {path}: {error}"]
    if not isinstance(data, dict):
        return False, [f"{path} does not hold a ledger"]
    try:
        reports = audit(cast("dict[str, Any]", data))
    except (LedgerError, KeyError, TypeError, ValueError) as error:
        return False, [f"{path}: {error}"]
    totals = cast("dict[str, int]", data["totals"])
    lines = [
        f"{path}: {data['dataset_size']} prompts; issued {totals['issued']}, trained {totals['trained']}, "
        f"handed back {totals['handed_back']}, dropped {totals['dropped']} "
        f"({totals['dropped_stale']} stale, issued again), open {totals['open']}"
    ]
    ok = True
    for report in reports:
        dropped = ", ".join(f"{n} {reason}" for reason, n in sorted(report.dropped.items())) or "none"
        state = "issued completely" if report.complete else "partly issued"
        verdict = "FAILED" if report.problems else "ok"
        lines.append(
            f"epoch {report.epoch} ({state}): {verdict}: trained once {report.trained}, dropped {dropped}, "
            f"open {report.open}"
        )
        lines.extend(f"  {problem}" for problem in report.problems)
        ok = ok and not report.problems
    return ok, lines
