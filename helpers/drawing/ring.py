"""Chapter 03's ring all-reduce step by step, drawn from the messages the ranks really sent.

(Chapter 10's ring attention has its own picture, ``helpers.drawing.ring_attention``.)

The ring cuts every rank's tensor into p chunks and makes 2(p-1) steps: in each, every
rank sends one chunk to its right neighbour. During the p-1 steps of the
reduce-scatter a chunk's partial sum travels around the ring collecting one
contribution per hop; during the p-1 steps of the all-gather the finished chunks
travel around once more. The picture shows that as a grid, one row per rank and one
column per chunk: a cell says which ranks' contributions that rank's copy of the chunk
holds after the step, and an arrow shows each message of the step, from the sender's
copy of the chunk to the receiver's.

Nothing in it is typed in. The ranks run the course's ring (``helpers.collectives``)
on a tensor whose values say where they came from, under the checks' spy
(``helpers.checks.spy``), which keeps a copy of every message sent. Rank r puts, in
every element of chunk c, the integer ``c * 2**p + 2**r``: a sum over a set S of
ranks is then ``|S| * c * 2**p + sum(2**r for r in S)``, so a message decodes back
into (its chunk, the ranks whose contributions it carries) (``decode``). The grid
after each step follows from the messages alone: the receiver's copy of the chunk
now holds what it held plus what arrived (``ring_steps``). Change the world size, the
ring's order or the ring itself and the picture changes with it.

    sends = launch(record_ring, 4)          # every rank's messages, as the spy saw them
    steps = ring_steps(sends)               # plain values: who sent what, who holds what
    show_ring(sends)                        # a slider over the steps (a strip on the site)
"""

from __future__ import annotations

from typing import Any

__all__ = ["encode", "decode", "record_ring", "ring_steps", "draw_ring_step", "draw_ring",
           "show_ring"]


def encode(rank: int, world: int, per_chunk: int = 2):
    """Rank ``rank``'s tensor: every element of chunk c holds ``c * 2**world + 2**rank``
    (int64, ``world * per_chunk`` elements, so every chunk has ``per_chunk``)."""
    import torch

    chunk = torch.arange(world, dtype=torch.int64).repeat_interleave(per_chunk)
    return chunk * 2 ** world + 2 ** rank


def decode(value: int, world: int) -> tuple[int, tuple[int, ...]]:
    """(chunk, contributing ranks) of a sum of ``encode`` values over a set of ranks."""
    value = int(value)
    mask = value % 2 ** world
    ranks = tuple(r for r in range(world) if mask >> r & 1)
    if not ranks:
        raise ValueError(f"{value} is no sum of encoded contributions for {world} ranks")
    chunk, rest = divmod(value // 2 ** world, len(ranks))
    if rest:
        raise ValueError(f"{value} is no sum of encoded contributions for {world} ranks")
    return chunk, ranks


def record_ring(per_chunk: int = 2, order=None) -> list:
    """Rank function: the course's ring all-reduce on ``encode``d values, under the
    checks' spy. Returns this rank's messages in posting order, each
    ``(destination, chunk, contributing ranks)``; raises if the sum is wrong."""
    import torch

    from helpers.checks.spy import communication_spy
    from helpers.collectives import ring_all_reduce
    from helpers.launch import rank_info

    r, p = rank_info().rank, rank_info().world_size
    x = encode(r, p, per_chunk).to(rank_info().device)
    with communication_spy() as spy:
        ring_all_reduce(x, order=order)
    want = sum(encode(q, p, per_chunk) for q in range(p))
    if not torch.equal(x.cpu(), want):
        raise RuntimeError(f"rank {r}: the ring's sum is wrong")
    out = []
    for dst, _, values in spy.sends:
        decoded = {decode(v, p) for v in values.tolist()}
        if len(decoded) != 1:
            raise RuntimeError(f"rank {r}: one message carried pieces of several chunks")
        out.append((dst, *decoded.pop()))
    return out


def ring_steps(sends: list) -> list[dict]:
    """The ring, step by step, from every rank's recorded messages (``record_ring``).

    ``sends[r]``: rank r's messages in posting order, ``(destination, chunk, ranks)``;
    rank r's s-th message is its message of step s (the course's ring sends one per step
    when chunks are below its 1 MB segment). Returns one dict per step:
    ``{"phase": "reduce-scatter" | "all-gather", "messages": [(src, dst, chunk, ranks)],
    "holds": holds[r][c] = sorted ranks whose contributions rank r's chunk c holds after
    the step}``: the receiver's copy adds what arrives (the reduce-scatter sums it in; in
    the all-gather the arriving chunk is complete, so it simply replaces the copy).
    """
    world = len(sends)
    if world < 2 or any(len(s) != len(sends[0]) for s in sends):
        raise ValueError("need the messages of at least 2 ranks, the same number from each")
    holds = [[{r} for _ in range(world)] for r in range(world)]
    steps = []
    for s in range(len(sends[0])):
        messages = [(src, dst, chunk, tuple(ranks))
                    for src in range(world) for dst, chunk, ranks in [sends[src][s]]]
        for _, dst, chunk, ranks in messages:
            holds[dst][chunk] |= set(ranks)
        steps.append({"phase": "reduce-scatter" if s < world - 1 else "all-gather",
                      "messages": messages,
                      "holds": [[sorted(h) for h in row] for row in holds]})
    return steps


def _cell_label(have: list[int], world: int) -> str:
    """What a rank's copy of a chunk holds: the ranks summed in it, "all" once complete
    (the short label keeps the text at ``FRAME_TEXT_PT`` inside a third of the column)."""
    return "all" if len(have) == world else "+".join(map(str, have))


def draw_ring_step(ax, steps: list[dict], step: int) -> None:
    """One frame: the grid after ``steps[step]``, with that step's messages as arrows."""
    from matplotlib.patches import FancyArrowPatch, Rectangle

    from helpers.drawing import FRAME_TEXT_PT, rank_color

    data = steps[step]
    holds, world = data["holds"], len(data["holds"])
    for r in range(world):
        for c in range(world):
            have = holds[r][c]
            full = len(have) == world
            ax.add_patch(Rectangle((c - 0.45, r - 0.4), 0.9, 0.8,
                                   facecolor=rank_color(c) if full else "white",
                                   alpha=0.35 if full else 1.0, edgecolor="0.6", lw=0.8))
            for q in have:  # rank q's bar sits at place q: a gap is a missing contribution
                ax.add_patch(Rectangle((c - 0.4 + 0.8 * q / world, r - 0.33),
                                       0.8 / world, 0.14, color=rank_color(q), lw=0))
            ax.text(c, r + 0.12, _cell_label(have, world), ha="center", va="center",
                    fontsize=FRAME_TEXT_PT)
    for src, dst, chunk, _ in data["messages"]:
        # the wrap-around hop (last rank to first) curves to the right of its column,
        # where the frame leaves room for it (xlim below)
        bend = 0.35 if abs(dst - src) > 1 else 0.0
        ax.add_patch(FancyArrowPatch((chunk + 0.25, src), (chunk + 0.25, dst),
                                     connectionstyle=f"arc3,rad={bend}", arrowstyle="-|>",
                                     mutation_scale=9, color=rank_color(src), lw=1.4,
                                     shrinkA=6, shrinkB=6))
    # an arc of rad 0.35 over a span of (world - 1) rows bulges 0.35 * (world - 1) / 2
    # sideways from the column's arrow at chunk + 0.25
    right = max(world - 0.4, world - 1 + 0.25 + 0.35 * (world - 1) / 2 + 0.1)
    ax.set_xlim(-0.6, right)
    ax.set_ylim(world - 0.5, -0.6)
    ax.set_xticks(range(world), [str(c) for c in range(world)], fontsize=FRAME_TEXT_PT)
    ax.set_yticks(range(world), [str(r) for r in range(world)], fontsize=FRAME_TEXT_PT)
    ax.set_xlabel("chunk", fontsize=FRAME_TEXT_PT, labelpad=1)
    ax.set_ylabel("rank", fontsize=FRAME_TEXT_PT, labelpad=1)
    first = step if data["phase"] == "reduce-scatter" else step - (world - 1)
    ax.set_title(f"{data['phase']} {first + 1}/{world - 1}", fontsize=FRAME_TEXT_PT + 1)
    ax.tick_params(length=0, pad=2)
    ax.grid(False)
    for side in ax.spines.values():
        side.set_visible(False)


def draw_ring(sends: list, **strip: Any):
    """Every step side by side (``helpers.drawing.draw_strip``; ``strip``: its keyword
    arguments, e.g. ``title``). Returns ``(fig, data)``, ``data`` being
    ``ring_steps(sends)``."""
    from helpers.drawing import draw_strip

    steps = ring_steps(sends)
    fig = draw_strip(lambda ax, s: draw_ring_step(ax, steps, s), len(steps), **strip)
    return fig, steps


def show_ring(sends: list, title: str | None = None) -> list[dict]:
    """A slider over the steps in JupyterLab, the strip of all of them as the stored
    picture (``helpers.drawing.step_frames``). Returns ``ring_steps(sends)``."""
    from helpers.drawing import step_frames

    steps = ring_steps(sends)
    step_frames(lambda ax, s: draw_ring_step(ax, steps, s), len(steps),
                frame_size=(3.4, 3.0), title=title)
    return steps
