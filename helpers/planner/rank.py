"""The planner's answer: a ranking of candidate layouts, and its explanations.

``Ranking`` holds the feasible candidates, ranked by ``search.plan`` (by
step time, ties within ``tie`` going to the simpler structure), and the
rejected ones with the rule each broke. ``explain`` walks one layout term by
term with the chapter that teaches each term, ``decide`` names the term in
which one layout pays most over another, ``find``/``rank_of`` look a
structure up, ``reasons`` counts the rejections by rule, ``table`` prints
the top of the list.
"""

from __future__ import annotations

import dataclasses
import math

from helpers.costs.gemm import GemmTable
from helpers.frameworks.plan import GPU, ModelSpec
from helpers.memory import GB
from helpers.planner.cost import axis_balance
from helpers.planner.layouts import CHAPTER, MEMORY_TERMS, TERMS, Candidate
from helpers.topology.links import Topology

__all__ = ["Ranking"]


@dataclasses.dataclass
class Ranking:
    """The planner's answer, a ranking of candidate layouts: ``ranked`` (feasible,
    fastest first) and ``rejected`` (each with the rule it broke). Not chapter 19's
    ``Plan``: that is one job's configuration, which ``Layout.to_plan`` builds."""

    model: ModelSpec
    global_batch: int
    gpu: GPU
    topology: Topology
    mfu: float
    ranked: list[Candidate]
    rejected: list[Candidate]
    gemm_table: GemmTable | None = None   # measured GEMM rates, or None: all at ``mfu``

    @property
    def best(self) -> Candidate:
        if not self.ranked:
            raise ValueError(f"no layout of {self.model.name} fits {self.topology.world_size} x "
                             f"{self.gpu.name}; most common reasons: {self.reasons(3)}")
        return self.ranked[0]

    def structures(self) -> list[Candidate]:
        """The best estimate of each (dp, tp, pp, cp, ep), fastest first."""
        seen, out = set(), []
        for e in self.ranked:
            if e.layout.structure not in seen:
                seen.add(e.layout.structure)
                out.append(e)
        return out

    def find(self, dp: int, tp: int, pp: int, cp: int = 1, ep: int = 1) -> Candidate:
        """The best feasible variant of a structure; if there is none, the rejected
        variant that got furthest (its reason says what stopped it)."""
        key = (dp, tp, pp, cp, ep)
        for e in self.ranked:
            if e.layout.structure == key:
                return e
        mine = [e for e in self.rejected if e.layout.structure == key]
        if not mine:
            raise ValueError(f"DP{dp} x TP{tp} x PP{pp} x CP{cp} x EP{ep} was not enumerated "
                             f"(degrees must multiply to {self.topology.world_size})")
        return min(mine, key=lambda e: (e.rule != "memory", e.memory_total or math.inf))

    def rank_of(self, dp: int, tp: int, pp: int, cp: int = 1, ep: int = 1) -> int | None:
        """1-based rank of a structure among structures (None if no variant is feasible)."""
        for i, e in enumerate(self.structures(), 1):
            if e.layout.structure == (dp, tp, pp, cp, ep):
                return i
        return None

    def reasons(self, k: int | None = None) -> list[tuple[str, int]]:
        """(rule, how many candidates it rejected), most common first."""
        counts: dict[str, int] = {}
        for e in self.rejected:
            counts[e.rule] = counts.get(e.rule, 0) + 1
        return sorted(counts.items(), key=lambda kv: -kv[1])[:k]

    def decide(self, a: Candidate, b: Candidate) -> tuple[str, float]:
        """(term, seconds): the term in which b pays most over a (the largest
        b - a): what makes b slower than a. The other terms' differences may
        partly offset it; all of them sum to b.step_time - a.step_time."""
        diffs = {t: b.time.get(t, 0.0) - a.time.get(t, 0.0) for t in TERMS}
        term = max(diffs, key=diffs.get)
        return term, diffs[term]

    def balance(self, est: Candidate | None = None) -> dict:
        """{axis: communication / compute seconds per step} of a feasible layout, largest
        first (``cost.axis_balance``): the roofline's verdict per axis, chapter 01."""
        e = est or self.best
        if not e.feasible:
            raise ValueError(f"{e.layout.short()} was rejected: {e.reason}")
        ratios = axis_balance(self.model, e.layout, self.global_batch, self.gpu,
                              self.topology, self.mfu, self.gemm_table)
        return dict(sorted(ratios.items(), key=lambda kv: -kv[1]))

    def bound_axis(self, est: Candidate | None = None) -> tuple[str, float] | None:
        """(axis, communication / compute) of the axis nearest to communication-bound,
        or None for a layout that communicates nothing (one GPU)."""
        ratios = self.balance(est)
        return next(iter(ratios.items()), None)

    def explain(self, est: Candidate | None = None) -> str:
        """One estimate, term by term, with the chapter that teaches each term."""
        e = est or self.best
        lines = [f"{self.model.name} on {self.topology.world_size} x {self.gpu.name}, global batch "
                 f"{self.global_batch} x {self.model.seq} tokens: {e.layout.short()}"]
        if not e.feasible:
            return lines[0] + f"\n  rejected: {e.reason}"
        lines.append(f"  memory per GPU {e.memory_total / GB:6.1f} GB of {self.gpu.memory / GB:g}:")
        for t in MEMORY_TERMS:
            if e.memory.get(t) or t != "gathered":   # ZeRO-3's gathered layers, if any
                lines.append(f"    {t:<12}{e.memory[t] / GB:8.2f} GB   (ch. {CHAPTER[t]})")
        if self.gemm_table is None:
            lines.append(f"  step time {e.step_time:.3f} s (MFU {e.mfu:.1%}, model FLOPs; the "
                         f"matmuls assumed at {self.mfu:.0%} of peak on the FLOPs executed):")
        else:
            lines.append(f"  step time {e.step_time:.3f} s (MFU {e.mfu:.1%}, model FLOPs; layer "
                         f"GEMMs at {e.gemm_efficiency:.0%} of peak, measured on "
                         f"{self.gemm_table.gpu}; attention and output layer assumed at "
                         f"{self.mfu:.0%}):")
        for t in TERMS:
            if e.time[t] or t in ("compute", "bubble", "dp_comm"):
                share = e.time[t] / e.step_time
                lines.append(f"    {t:<12}{e.time[t]:8.3f} s  {share:6.1%}   (ch. {CHAPTER[t]})")
        bound = self.bound_axis(e)
        if bound is not None:
            axis, ratio = bound
            verdict = (f"communication-bound: its collectives take {ratio:.2f}x the compute"
                       if ratio > 1 else
                       f"compute-bound by {1 / ratio:.1f}x: its collectives take {ratio:.0%} "
                       f"of the compute")
            others = ", ".join(f"{a} {r:.2f}" for a, r in list(self.balance(e).items())[1:])
            lines.append(f"  roofline (ch. 01): the bound axis is {axis}, {verdict}"
                         + (f" (communication / compute of the others: {others})"
                            if others else ""))
        return "\n".join(lines)

    def table(self, k: int = 8, per_structure: bool = True) -> str:
        rows = self.structures() if per_structure else self.ranked
        head = f"{'#':>3}  {'layout':<48}{'GB/GPU':>8}{'step s':>9}{'MFU':>7}"
        out = [head]
        for i, e in enumerate(rows[:k], 1):
            out.append(f"{i:>3}  {e.layout.short():<48}{e.memory_total / GB:8.1f}"
                       f"{e.step_time:9.3f}{e.mfu:7.1%}")
        return "\n".join(out)
