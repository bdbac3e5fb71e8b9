"""Line up every rank's collective record and name the first disagreement.

What
----
Every rank of a process group must issue the same collectives, in the same
order, with the same shapes and dtypes: the i-th collective of one rank pairs
with the i-th of every other rank of that group (that is how NCCL and gloo
match them: by order, not by name). So a record of each rank's calls
(``helpers.debug.recorder``) turns "the job hangs" into a lookup: walk the
ranks' lists side by side, per group, and stop at the first index where

* the ranks called different things: ``rank 1's call #7 is broadcast [4]
  float32 at Cell In[3], line 12; ranks 0, 2, 3 called all_reduce [4]
  float32`` (a different order, a skipped call, a data-dependent branch, a
  shape or dtype mismatch all look like this), or
* some ranks never arrived: the others wait in call #7 while rank 1's record
  stops at #6, and the launch says why (it returned, raised, died, or was
  still busy elsewhere at the timeout).

The odd one out is named against the majority (on a tie, against the group
containing the lowest rank). Point-to-point calls are matched per pair of
ranks instead: the k-th send from a to b pairs with the k-th recv on b from a.

``arrival_lateness`` / ``straggler`` use the same alignment for a healthy run:
at each collective the rank that arrives last is the one everybody waited for.

How production differs: PyTorch's flight-recorder analyzer
(``python -m torch.distributed.flight_recorder.fr_trace``) does this on the
per-rank dumps of the NCCL flight recorder, matching by each process group's
sequence number; it also knows each collective's state on the GPU
(scheduled / started / completed), which tells a rank that never launched a
kernel from one whose kernel never finished.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter, defaultdict

from helpers.debug.recorder import CallRecord, describe_where
from helpers.launch.hooks import register_failure_report, register_success_check, register_watch

__all__ = ["Finding", "assemble", "first_disagreement", "explain", "arrival_lateness",
           "straggler"]


@dataclasses.dataclass
class Finding:
    """The first disagreement: ``ranks`` are the odd ones out, ``calls`` their
    records (None for a rank that never made the call), ``text`` says it."""

    kind: str                        # "mismatch", "missing", "p2p", "hung"
    ranks: list[int]
    calls: dict[int, CallRecord | None]
    text: str


def assemble(events: dict[int, list[tuple]]) -> dict[int, list[CallRecord]]:
    """Per-rank records from the recorded events ("call", rec) / ("end", seq, t, outcome)
    / ("returned", seq, t): on a GPU a call returns (queued) before it completes."""
    out: dict[int, list[CallRecord]] = {}
    for rank, evs in events.items():
        by_seq: dict[int, CallRecord] = {}
        for ev in evs:
            if ev[0] == "call":
                by_seq[ev[1].seq] = ev[1]
            elif ev[0] == "end" and ev[1] in by_seq:
                by_seq[ev[1]].end, by_seq[ev[1]].outcome = ev[2], ev[3]
            elif ev[0] == "returned" and ev[1] in by_seq:
                by_seq[ev[1]].returned = ev[2]
        out[rank] = [by_seq[s] for s in sorted(by_seq)]
    return out


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _call(rec: CallRecord) -> str:
    return f"call #{rec.seq} is {rec.describe()} at {describe_where(rec.where)}"


def _by_group(records: dict[int, list[CallRecord]]) -> dict[tuple, dict[int, list[CallRecord]]]:
    """group -> rank -> that rank's collectives in that group, in order."""
    groups: dict[tuple, dict[int, list[CallRecord]]] = defaultdict(lambda: defaultdict(list))
    for rank, calls in records.items():
        for c in calls:
            if not c.is_p2p:
                groups[c.group][rank].append(c)
    return groups


def _completed_or_returned(rec: CallRecord) -> str:
    """'completed' for a call the host saw return (queued on a GPU) that the GPU never
    finished; 'returned' for one the host is still inside."""
    return "completed (it returned: queued on the GPU)" if rec.returned is not None else "returned"


def _after(rank: int, records, status) -> str:
    """What became of a rank after its last record."""
    calls = records.get(rank, [])
    last = calls[-1] if calls else None
    if last is not None and last.end is None:
        return f"it is stuck in its call #{last.seq} ({last.describe()} at " \
               f"{describe_where(last.where)}), which never {_completed_or_returned(last)}"
    said = (status or {}).get(rank)
    return f"then it {said}" if said else "then it made no further call"


def _collective_findings(records, status) -> list[Finding]:
    findings = []
    known = set(records) | set(status or {})  # a rank with no record at all still counts
    for group, seqs in _by_group(records).items():
        members = [r for r in group if r in known]
        for i in range(max(len(seqs[r]) for r in members)):
            present = {r: seqs[r][i] for r in members if i < len(seqs[r])}
            sigs = Counter(c.signature() for c in present.values())
            if len(sigs) > 1:  # they called different things
                # Majority; on a tie, the signature of the lowest rank.
                best = max(sigs.values())
                ref_sig = next(present[r].signature() for r in sorted(present)
                               if sigs[present[r].signature()] == best)
                agree = [r for r in present if present[r].signature() == ref_sig]
                odd = [r for r in sorted(present) if r not in agree]
                ref = present[agree[0]]
                lines = [f"{_ranks([r])}'s {_call(present[r])}" for r in odd]
                text = "; ".join(lines) + (
                    f"; {_ranks(agree)} called {ref.describe()} "
                    f"(call #{ref.seq} at {describe_where(ref.where)})")
                findings.append(Finding("mismatch", odd, {r: present[r] for r in odd}, text))
                break
            if len(present) < len(members):  # some never made this call
                missing = [r for r in members if r not in present]
                ref = next(iter(present.values()))
                text = (f"{_ranks(present)} are in {ref.describe()} (call #{ref.seq} at "
                        f"{describe_where(ref.where)}); "
                        + "; ".join(f"{_ranks([r])} never called it: "
                                    f"{_last_in_group(r, seqs)}, {_after(r, records, status)}"
                                    for r in missing))
                findings.append(Finding("missing", missing, {r: None for r in missing}, text))
                break
    return findings


def _last_in_group(rank, seqs) -> str:
    mine = seqs[rank]
    if not mine:
        return "it made no collective call in this group"
    return f"its last one was call #{mine[-1].seq}, {mine[-1].describe()} at " \
           f"{describe_where(mine[-1].where)}"


def _p2p_findings(records) -> list[Finding]:
    """The k-th send a -> b pairs with the k-th recv on b from a."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for rank, calls in records.items():
        for c in calls:
            if c.op in ("send", "isend") and c.peer is not None:
                sends[rank, c.peer].append(c)
            elif c.op in ("recv", "irecv") and c.peer is not None:
                recvs[c.peer, rank].append(c)
    findings = []
    for a, b in sorted(set(sends) | set(recvs)):
        s, r = sends[a, b], recvs[a, b]
        for k in range(max(len(s), len(r))):
            if k < len(s) and k < len(r):
                if (s[k].shapes, s[k].dtypes) != (r[k].shapes, r[k].dtypes):
                    text = (f"rank {a}'s {_call(s[k])}; rank {b}'s matching {_call(r[k])}")
                    findings.append(Finding("p2p", [a, b], {a: s[k], b: r[k]}, text))
                    break
                continue
            if k >= len(s) and r[k].end is None:
                text = (f"rank {b} waits in {_call(r[k])}; rank {a} sent it only "
                        f"{len(s)} message(s)")
                findings.append(Finding("p2p", [a], {a: None, b: r[k]}, text))
                break
            if k >= len(r) and s[k].end is None:
                text = (f"rank {a} waits in {_call(s[k])}; rank {b} posted only "
                        f"{len(r)} matching recv(s)")
                findings.append(Finding("p2p", [b], {a: s[k], b: None}, text))
                break
    return findings


def first_disagreement(records: dict[int, list[CallRecord]],
                       status: dict[int, str] | None = None) -> Finding | None:
    """The earliest disagreement across ranks, or None if every rank agrees and
    every call returned. ``status``: what became of each rank ("returned",
    "raised ValueError", "was still running at the timeout"), for the text."""
    findings = _collective_findings(records, status) + _p2p_findings(records)
    if findings:
        def when(f):  # the earliest call involved; a missing call counts as "now"
            starts = [c.start for c in f.calls.values() if c is not None]
            return min(starts) if starts else float("inf")
        return min(findings, key=when)
    hung = [c for calls in records.values() for c in calls if c.end is None]
    if hung:
        first = min(hung, key=lambda c: c.start)
        return Finding("hung", [first.rank], {first.rank: first},
                       f"every rank agrees, but rank {first.rank}'s {_call(first)}, "
                       f"never {_completed_or_returned(first)}")
    return None


def explain(records: dict[int, list[CallRecord]], status: dict[int, str] | None = None) -> str:
    """The report a failed launch ends with: the first disagreement, then each
    rank's last recorded call."""
    finding = first_disagreement(records, status)
    lines = ["Collective record, first disagreement:",
             "  " + (finding.text if finding else "none: every rank made the same calls, "
                     "and every call returned"),
             "Last call of each rank:"]
    for rank in sorted(set(records) | set(status or {})):
        calls = records.get(rank, [])
        if calls:
            last = calls[-1]
            lines.append(f"  rank {rank}: #{last.seq} {last.describe()} at "
                         f"{describe_where(last.where)} ({last.state})")
        else:
            lines.append(f"  rank {rank}: no recorded call")
    return "\n".join(lines)


def arrival_lateness(records: dict[int, list[CallRecord]]) -> dict[int, list[float]]:
    """Seconds each rank arrived after the first rank, at every collective that
    all ranks of its group called alike (a healthy run's straggler signal)."""
    late: dict[int, list[float]] = defaultdict(list)
    for group, seqs in _by_group(records).items():
        members = [r for r in group if r in records]
        for i in range(min(len(seqs[r]) for r in members)):
            calls = [seqs[r][i] for r in members]
            if len({c.signature() for c in calls}) != 1:
                break
            first = min(c.start for c in calls)
            for c in calls:
                late[c.rank].append(c.start - first)
    return dict(late)


def straggler(records: dict[int, list[CallRecord]]) -> tuple[int, float] | None:
    """(rank, median seconds late) of the rank that arrives last most often;
    None with fewer than two ranks or no common collective. The median, not the
    mean: one slow call (a page fault, the first call's warm-up) should not
    make a straggler."""
    late = arrival_lateness(records)
    if len(late) < 2:
        return None
    medians = {r: statistics.median(v) for r, v in late.items() if v}
    rank = max(medians, key=medians.get)
    return rank, medians[rank]


def report_failure(err, events: dict[int, list[tuple]], status: dict[int, str]) -> None:
    """A failed launch's report (registered with helpers.launch.hooks): the
    error's message ends with the cross-rank diff of the recorded calls, and
    ``err.records`` / ``err.diff`` hold them."""
    records = assemble(events)
    if not any(records.values()):  # the events are another part's (NCCL's rules)
        return
    err.records = records
    err.diff = explain(err.records, status)
    err.args = (f"{err.args[0]}\n\n{err.diff}",) + err.args[1:]


_SENDS, _RECVS = ("send", "isend"), ("recv", "irecv")


def stuck_for_good(records: dict[int, list[CallRecord]], returned: set[int]) -> Finding | None:
    """A rank inside a call that can never complete, because a rank it needs has already
    returned from the rank function without making its side: a collective of a group
    that rank belongs to (it made fewer calls in that group), or a send or receive whose
    peer returned with fewer matching receives or sends. None if there is none.
    (A rank blocked in ``work.wait()`` of an async call is not inside a recorded call:
    only the timeout finds that one.)"""
    groups = _by_group(records)
    for rank in sorted(records):
        calls = records[rank]
        if rank in returned or not calls or calls[-1].end is not None:
            continue
        last = calls[-1]
        if last.is_p2p:
            peer = last.peer
            if peer not in returned:
                continue
            mine, theirs = (_SENDS, _RECVS) if last.op in _SENDS else (_RECVS, _SENDS)
            k = [c for c in calls if c.op in mine and c.peer == peer].index(last)
            made = [c for c in records.get(peer, []) if c.op in theirs and c.peer == rank]
            if len(made) <= k:
                return Finding("stuck", [rank], {rank: last},
                               f"rank {rank} waits in {_call(last)}; rank {peer} returned from "
                               f"the rank function with only {len(made)} matching "
                               f"{'receive' if last.op in _SENDS else 'send'}(s)")
            continue
        k = groups[last.group][rank].index(last)
        gone = [f for f in last.group if f in returned and len(groups[last.group].get(f, [])) <= k]
        if gone:
            return Finding("stuck", [rank], {rank: last},
                           f"rank {rank} waits in {_call(last)}; {_ranks(gone)} of its group "
                           f"returned from the rank function without making that call "
                           f"({_last_in_group(gone[0], groups[last.group])})")
    return None


def watch_progress(events: dict[int, list[tuple]], returned: set[int]):
    """The launcher's watch (helpers.launch.hooks): once some ranks returned, a rank that
    waits for one of them can never finish; say so now, a RankTimeout with the reason,
    instead of at the end of the timeout."""
    from helpers.launch import RankTimeout

    records = assemble(events)
    running = sorted(r for r in records if r not in returned)
    # Only once every rank still running sits in a call: a rank still computing could
    # yet reach its next call, and the record (what the diff shows) would be half-written.
    if not all(records[r] and records[r][-1].end is None for r in running):
        return None
    finding = stuck_for_good(records, returned)
    if finding is None:
        return None
    return RankTimeout(f"rank(s) {running} can never finish: {finding.text}. A deadlock, "
                       f"seen in the ranks' records before the timeout. All ranks were "
                       f"stopped.", running)


def check_agreement(events: dict[int, list[tuple]]):
    """A launch whose ranks all returned, checked (registered with helpers.launch.hooks):
    if their recorded calls disagree (another collective, shape or dtype at the same
    place, or a send and its receive of different sizes), a RankError with the diff.
    gloo nearly always fails on such a mismatch by itself; nccl checks nothing and can
    complete it with wrong data, and the launch would return as if all were well."""
    from helpers.launch import RankError

    records = assemble(events)
    finding = first_disagreement(records) if any(records.values()) else None
    if finding is None or finding.kind not in ("mismatch", "p2p"):
        return None
    err = RankError(f"every rank returned, but their recorded calls disagree: "
                    f"{_ranks(finding.ranks)} made another call than the others. gloo "
                    f"usually fails on such a mismatch; nccl may complete it with wrong "
                    f"data, or hang.", rank=finding.ranks[0], exc_type="mismatch")
    err.records = records
    err.diff = explain(records, {r: "returned from the rank function" for r in records})
    err.args = (f"{err.args[0]}\n\n{err.diff}",) + err.args[1:]
    return err


register_failure_report(report_failure)
register_success_check(check_agreement)
register_watch(watch_progress)
