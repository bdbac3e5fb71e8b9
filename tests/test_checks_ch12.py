"""Chapter 12's checks pass on the solution, fail on the lab's stub, on GPipe order and
on a schedule that deadlocks."""

from checks_harness import ChapterChecks, Check, Wrong
from helpers.checks import ch12
from helpers.pipeline import B, F, gpipe
from tools.nbtool import exercise

SOL = "solutions/12_pipeline_schedules_solution.ipynb"


def reversed_warmup(p, m):
    """Rank r warms up with r forwards instead of p - r - 1: deadlocks for p >= 2."""
    return [[F(j) for j in range(min(r, m))]
            + [a for k in range(m - min(r, m)) for a in (F(k + min(r, m)), B(k))]
            + [B(j) for j in range(m - min(r, m), m)] for r in range(p)]


def one_short(p, m):
    """Warm-up one forward short (p - r - 2): valid and deadlock-free, but not 1F1B."""
    out = []
    for r in range(p):
        w = max(min(p - r - 2, m), 0)
        out.append([F(j) for j in range(w)] + [a for k in range(m - w) for a in (F(k + w), B(k))]
                   + [B(j) for j in range(m - w, m)])
    return out


def warmup_for_two(p, m):
    """Warm-up written while looking at 2 ranks: rank 0 one forward, rank 1 none."""
    out = []
    for r in range(p):
        w = min(max(1 - r, 0), m)
        out.append([F(j) for j in range(w)] + [a for k in range(m - w) for a in (F(k + w), B(k))]
                   + [B(j) for j in range(m - w, m)])
    return out


def warmup_uncapped(p, m):
    """Warm-up of p - r - 1 forwards, not capped at m: F(j) for micro-batches that don't
    exist when m < p."""
    out = []
    for r in range(p):
        w = p - r - 1
        out.append([F(j) for j in range(w)] + [a for k in range(m - w) for a in (F(k + w), B(k))]
                   + [B(j) for j in range(max(m - w, 0), m)])
    return out


def _prints_schedule(p, m):  # builds the schedule, forgets to return it
    print(exercise(SOL, "one_f_one_b")(p, m))


def _flat(p, m):  # one list for all ranks
    return [a for row in exercise(SOL, "one_f_one_b")(p, m) for a in row]


def _course_1f1b(p, m):  # the chapter's own generator, one line
    from helpers.pipeline import one_f_one_b
    return one_f_one_b(p, m)


def _course_interleaved(p, m):  # the chapter's interleaved generator with v = 1
    from helpers.pipeline import interleaved_1f1b
    return interleaved_1f1b(p, m, 1)


def _course_zb(p, m):  # the chapter's own ZB-H1
    from helpers.pipeline import zb_h1
    return zb_h1(p, m)


def _course_bubble(p, m, v=1):  # the chapter's own formula
    from helpers.pipeline import bubble_formula
    return bubble_formula(p, m, v)


def _w_after_b(p, m):
    """1F1B with every backward cut into B and W, W at once: valid, 1F1B's bubble."""
    from helpers.pipeline import W, one_f_one_b
    return [[x for a in row for x in ([a] if a.kind == "F" else [a, W(a.microbatch)])]
            for row in one_f_one_b(p, m)]


def _all_w_last(p, m):
    """Every W postponed to the end: the smallest bubble, but m micro-batches held."""
    from helpers.pipeline import W, one_f_one_b
    return [row + [W(j) for j in range(m)] for row in one_f_one_b(p, m)]


def _w_before_b(p, m):
    from helpers.pipeline import W, one_f_one_b
    return [[x for a in row for x in ([a] if a.kind == "F" else [W(a.microbatch), a])]
            for row in one_f_one_b(p, m)]


class TestChapter12(ChapterChecks):
    lab, sol = "labs/12_pipeline_schedules_lab.ipynb", SOL
    checks = {
        "bubble_fraction": Check(ch12.check_bubble_fraction),
        "one_f_one_b": Check(ch12.check_one_f_one_b),
        # the stub and a deadlocking schedule fail before any rank starts
        "one_f_one_b on ranks": Check(ch12.check_one_f_one_b_on_ranks, "one_f_one_b", slow=True, wire="p2p"),
        "zb_h1": Check(ch12.check_zb_h1),
    }
    wrong = [
        Wrong("bubble_fraction", lambda p, m, v=1: (p - 1) / (v * m),
              "relative to the whole step, not the ideal", says="relative to the ideal"),
        Wrong("bubble_fraction", lambda p, m, v=1: (p - 1) / (m + p - 1),
              "forgets that interleaving divides the fill by v", says=None),
        Wrong("one_f_one_b", gpipe, "GPipe order", says=r"holds up to \[2\] micro-batches"),
        Wrong("one_f_one_b", reversed_warmup, "warm-up of r forwards: deadlock",
              says="can never finish.*deadlocks"),
        Wrong("one_f_one_b", one_short, "warm-up one forward short", says=None),
        Wrong("bubble_fraction", lambda p, m, v=1: (p - 1) // (v * m + p - 1),
              "integer division", says=r"bubble_fraction\(2, 2, 1\) = 0.0000"),
        Wrong("bubble_fraction", lambda p, m, v=1: (m - 1) / (v * p + m - 1),
              "p and m swapped", says=r"bubble_fraction\(4, 16, 1\)"),
        Wrong("bubble_fraction", lambda p, m, v=1: str((p - 1) / (v * m + p - 1)),
              "returns a formatted string", says="should be a number"),
        Wrong("bubble_fraction", lambda p, m: (p - 1) / (m + p - 1),
              "no v parameter", says="raised TypeError"),
        Wrong("one_f_one_b", warmup_for_two, "warm-up hard-coded for 2 ranks",
              says=r"one_f_one_b\(1, "),
        Wrong("one_f_one_b", warmup_uncapped, "warm-up not capped at m",
              says="not a valid schedule"),
        Wrong("one_f_one_b", _prints_schedule, "returns None", says="returned None"),
        Wrong("one_f_one_b", _flat, "one flat list for all ranks",
              says="one list of actions per rank|not a valid schedule"),
        Wrong("one_f_one_b on ranks", warmup_uncapped, "warm-up not capped at m",
              says=r"one_f_one_b\(4, 2\) is not a valid schedule"),
        Wrong("zb_h1", _prints_schedule, "returns None", says="returned None"),
        Wrong("one_f_one_b", lambda p, m: [[F(j) for j in range(m)] for _ in range(p)],
              "forwards only", says="not a valid schedule"),
        Wrong("one_f_one_b on ranks", reversed_warmup, "warm-up of r forwards: deadlock",
              says="can never finish"),
        # GPipe order runs correctly on the ranks, but its measured stash gives it away
        Wrong("one_f_one_b on ranks", gpipe, "GPipe order",
              says=r"measured peak stash \[4, 4, 4\]"),
        # the hint must not say "the same bubble": splitting B sends the input gradient a W
        # earlier, so the bubble is smaller than 1F1B's (20.0 % vs 27.3 % at p = 4, m = 8)
        Wrong("zb_h1", _w_after_b, "W right after its B",
              says="W runs right after its B: that is 1F1B with the backward cut in two, "
                   "which keeps most of"),
        Wrong("one_f_one_b", _course_1f1b, "the course's one_f_one_b", says="course's own answer"),
        Wrong("one_f_one_b", _course_interleaved, "the course's interleaved_1f1b, v = 1",
              says="course's own answer"),
        Wrong("zb_h1", _course_zb, "the course's zb_h1", says="course's own answer"),
        Wrong("bubble_fraction", _course_bubble, "the course's bubble_formula",
              says="course's own answer"),
        Wrong("zb_h1", _all_w_last, "every W postponed to the end", says="keeps 1F1B's memory"),
        Wrong("zb_h1", _w_before_b, "W before its B",
              says="comes before its input-gradient backward"),
        Wrong("zb_h1", lambda p, m: exercise(SOL, "one_f_one_b")(p, m), "plain 1F1B, no W",
              says="no W actions"),
    ]
