"""What the consumer checks, and the figures a soak reports.

Lost: committed (in the table at the end) but never delivered. Phantom: delivered but not
committed. Taken back: acknowledged to a writer by a primary that then failed before its
standby had the commit; the database lost it, and a message for it would be a phantom.
Inversion: an aggregate's first deliveries on one destination out of version order.
Regression: the checkpoint seen lower than before. Re-sent messages are counted and charged
to the fault that preceded them.
"""

from __future__ import annotations

import bisect
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from tests.soak.brokers import Delivery
from tests.soak.faults import Fault, Lost
from tests.soak.schedule import ALL_KINDS
from tests.soak.writers import Ledger


@dataclass(frozen=True)
class AuditCheck:
    """What the continuous audit must have seen: every message a LOSE fault deleted (unless
    the relay had stored it again by itself), and nothing else."""

    repairs: bool
    deleted: list[Lost]
    reported: set[str]  # message ids the replicas' audits logged as missing


@dataclass
class Verdict:
    seed: int
    broker: str
    committed: int
    delivered: int
    lost: list[str]
    phantoms: list[str]
    inversions: list[str]
    regressions: list[str]
    drained: bool
    ledger_problems: list[str]
    faults: list[Fault]
    resent: dict[str, int]
    resume: dict[str, list[float]]
    uncertain: tuple[int, int]  # (appeared, did not)
    restarts: int
    writer_kinds: dict[str, int] = field(default_factory=dict)
    taken_back: list[str] = field(default_factory=list)
    audit: AuditCheck | None = None
    undetected: list[str] = field(default_factory=list)  # deleted, not found by the audit
    false_alarms: list[str] = field(default_factory=list)  # reported, never deleted

    @property
    def ok(self) -> bool:
        return (
            not (self.lost or self.phantoms or self.inversions or self.regressions)
            and self.drained
            and not self.ledger_problems
            and not (self.undetected or self.false_alarms)
        )

    def report(self, origin: float) -> str:
        counts = Counter(f.kind for f in self.faults)
        lines = [
            f"soak seed={self.seed} broker={self.broker}: {'PASS' if self.ok else 'FAIL'}",
            f"  events committed {self.committed}, messages stored {self.delivered},"
            f" replica restarts {self.restarts}, writer transactions {self.writer_kinds}",
            f"  lost {len(self.lost)}, phantom {len(self.phantoms)},"
            f" inversions {len(self.inversions)}, regressions {len(self.regressions)},"
            f" drained {self.drained}",
            f"  uncertain commits: {self.uncertain[0]} appeared, {self.uncertain[1]} did not",
            f"  acknowledged commits that failovers took back: {len(self.taken_back)}",
            *self._audit_lines(),
            "  fault                     count  re-sent  resumed p50 / max (s)",
        ]
        for kind in (*ALL_KINDS, "before any fault"):
            if kind not in counts and not self.resent.get(kind):
                continue
            times = self.resume.get(kind, [])
            timing = f"{statistics.median(times):6.2f} / {max(times):6.2f}" if times else "     -"
            lines.append(
                f"  {kind:<24} {counts.get(kind, 0):6} {self.resent.get(kind, 0):8}  {timing}"
            )
        for name, items in (
            ("lost", self.lost),
            ("phantoms", self.phantoms),
            ("inversions", self.inversions),
            ("regressions", self.regressions),
            ("ledger", self.ledger_problems),
            ("undetected by the audit", self.undetected),
            ("audit false alarms", self.false_alarms),
        ):
            if items:
                lines.append(f"  {name}: {items[:10]}")
        lines.append("  faults in order:")
        lines += [f"    {f.describe(origin)}" for f in self.faults]
        return "\n".join(lines)

    def _audit_lines(self) -> list[str]:
        if self.audit is None:
            return []
        mode = "repairing" if self.audit.repairs else "reporting"
        return [
            f"  continuous audit ({mode}): {len(self.audit.deleted)} message(s) deleted by"
            f" faults, {len(self.audit.reported)} reported missing, undetected"
            f" {len(self.undetected)}, false alarms {len(self.false_alarms)}"
        ]


def judge(
    *,
    seed: int,
    broker: str,
    deliveries: list[Delivery],
    table: set[str],
    ledger: Ledger,
    faults: list[Fault],
    regressions: list[str],
    drained: bool,
    restarts: int,
    unreplicated: list[tuple[float, float]],
    audit: AuditCheck | None = None,
) -> Verdict:
    delivered = {d.uid for d in deliveries}
    taken_back = _taken_back(ledger, table, unreplicated)
    lost = table - delivered
    undetected: list[str] = []
    false_alarms: list[str] = []
    if audit is not None:
        deleted = {m.id for m in audit.deleted}
        # A deleted message the relay stored again by itself (a takeover's re-send) is not
        # missing: the audit need not have reported it. Any other must have been reported.
        stored = {d.id for d in deliveries}
        undetected = sorted(i for i in deleted - audit.reported if i not in stored)
        false_alarms = sorted(audit.reported - deleted)
        if not audit.repairs:  # reported and left missing, as asked: not lost to the judge
            lost -= {m.uid for m in audit.deleted if m.id in audit.reported}
    return Verdict(
        seed=seed,
        broker=broker,
        committed=len(table),
        delivered=len(deliveries),
        lost=sorted(lost),
        phantoms=sorted(delivered - table),
        # A message put back by a repair is published after later versions, by nature.
        inversions=_inversions(deliveries, {m.id for m in audit.deleted} if audit else set()),
        regressions=regressions,
        drained=drained,
        ledger_problems=_ledger_problems(ledger, table, set(taken_back)),
        faults=faults,
        resent=_resent(deliveries, faults),
        resume=_resume_times(deliveries, faults),
        uncertain=(len(ledger.uncertain & table), len(ledger.uncertain - table)),
        restarts=restarts,
        writer_kinds=dict(ledger.kinds),
        taken_back=taken_back,
        audit=audit,
        undetected=undetected,
        false_alarms=false_alarms,
    )


def _inversions(deliveries: list[Delivery], put_back: set[str]) -> list[str]:
    seen: set[str] = set(put_back)
    last: dict[tuple[str, str], int] = {}
    out = []
    for d in deliveries:
        if d.id in seen:
            continue  # only first deliveries must be in order
        seen.add(d.id)
        key = (d.destination, d.aggregate)
        if d.version <= last.get(key, 0):
            out.append(f"{d.id} after version {last[key]} on {d.destination}")
        last[key] = max(last.get(key, 0), d.version)
    return out


def _taken_back(
    ledger: Ledger, table: set[str], unreplicated: list[tuple[float, float]]
) -> list[str]:
    """Acknowledged commits missing from the table that a failover explains: acknowledged
    after the standby was last seen caught up, before the failover ended."""
    return sorted(
        uid
        for uid in ledger.committed - table
        if any(start <= ledger.acknowledged_at[uid] <= end for start, end in unreplicated)
    )


def _ledger_problems(ledger: Ledger, table: set[str], taken_back: set[str]) -> list[str]:
    """The writers' own view must agree with the table (else the harness is wrong)."""
    missing = ledger.committed - table - taken_back
    problems = [f"acknowledged commit {u} is not in the table" for u in missing]
    problems += [f"rolled back {u} is in the table" for u in ledger.rolled_back & table]
    return sorted(problems)


def _charged_to(when: float, faults: list[Fault]) -> str:
    kind = "before any fault"
    for fault in faults:
        if fault.started <= when:
            kind = fault.kind
    return kind


def _resent(deliveries: list[Delivery], faults: list[Fault]) -> dict[str, int]:
    seen: set[str] = set()
    out: dict[str, int] = defaultdict(int)
    for d in deliveries:
        if d.id in seen:
            out[_charged_to(d.stored_at, faults)] += 1
        seen.add(d.id)
    return dict(out)


def _resume_times(deliveries: list[Delivery], faults: list[Fault]) -> dict[str, list[float]]:
    """From each fault's end to the first message stored after it (if before the next fault)."""
    stamps = sorted(d.stored_at for d in deliveries)
    out: dict[str, list[float]] = defaultdict(list)
    for i, fault in enumerate(faults):
        following = faults[i + 1].started if i + 1 < len(faults) else float("inf")
        index = bisect.bisect_left(stamps, fault.ended)
        if index < len(stamps) and stamps[index] < following:
            out[fault.kind].append(stamps[index] - fault.ended)
    return dict(out)
