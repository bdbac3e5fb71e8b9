"""Expert parallelism as a picture: which token went to which expert, and what that made
each rank send.

An MoE layer's router picks, for each token, its k best experts (``helpers.moe.route``);
with expert parallelism over P ranks, rank q holds experts [q E/P, (q+1) E/P), so every
choice of an expert held elsewhere is a row this rank must send in the dispatch
all-to-all (and receive back in the combine). How many rows go where is known only after
routing, which is why the split sizes are exchanged first (chapter 21).

``MoELayer`` records both on every rank (``MoEStats``): ``experts`` (T, k), the router's
choices, ``kept`` (T, k), which of them fit their expert's capacity, and ``send_splits``,
the rows it sent to each rank. ``draw_routing`` draws, for each rank, its tokens against
the experts, each choice coloured by the rank that holds the expert (crossed out if it was
dropped for capacity), and beside them the all-to-all as a P x P matrix of rows sent,
source rank by destination. Read a rank's panel by colour: the cells of other ranks'
colours are the rows that travel; their count per colour is that row of the matrix. An
uneven router shows as a column of the token panels much fuller than the others, and as a
destination rank receiving more rows than it sends.
"""

from __future__ import annotations

from helpers.drawing import rank_color

__all__ = ["routing_record", "draw_routing"]


def routing_record(stats: list, num_experts: int) -> dict:
    """The picture's data from each rank's ``MoEStats``: ``experts`` and ``kept`` (T x k
    lists per rank), ``owner`` (expert -> rank), ``sends`` (P x P rows sent, as each rank
    recorded them: ``send_splits``) and ``counted`` (the same matrix counted from the
    choices: kept choices of rank q's experts)."""
    P = len(stats)
    per_rank = num_experts // P
    owner = [e // per_rank for e in range(num_experts)]
    experts = [s.experts.tolist() for s in stats]
    kept = [s.kept.tolist() for s in stats]
    counted = [[sum(1 for toks, ks in zip(experts[r], kept[r]) for e, k in zip(toks, ks)
                    if k and owner[e] == q) for q in range(P)] for r in range(P)]
    return {"experts": experts, "kept": kept, "owner": owner, "num_experts": num_experts,
            "sends": [list(map(int, s.send_splits)) for s in stats], "counted": counted}


def draw_routing(stats: list, num_experts: int, *, max_tokens: int = 32,
                 row_bytes: int | None = None, title: str | None = None):
    """Each rank's routing (its first ``max_tokens`` tokens) and the dispatch all-to-all's
    rows (see the module docstring); returns (fig, data), ``data`` = ``routing_record``.
    ``row_bytes``: bytes of one row, to label the matrix in bytes too."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    data = routing_record(stats, num_experts)
    P, E = len(stats), num_experts
    fig, axes = plt.subplots(1, P + 1, figsize=(2.2 * P + 3.2, 4.2),
                             gridspec_kw={"width_ratios": [1] * P + [1.3]})
    for r in range(P):
        ax = axes[r]
        tokens = data["experts"][r][:max_tokens]
        for t, (choices, keep) in enumerate(zip(tokens, data["kept"][r])):
            for e, k in zip(choices, keep):
                ax.add_patch(Rectangle((e, t), 0.95, 0.9, facecolor=rank_color(data["owner"][e]),
                                       alpha=0.85 if k else 0.25, edgecolor="none"))
                if not k:
                    ax.plot([e + 0.1, e + 0.85], [t + 0.1, t + 0.8], color="black", lw=0.8)
        ax.set_xlim(0, E)
        ax.set_ylim(len(tokens), 0)
        ax.set_xticks([e + 0.47 for e in range(E)], range(E), fontsize=6)
        ax.set_yticks([])
        ax.set_xlabel("expert", fontsize=8)
        ax.set_title(f"rank {r}'s tokens", fontsize=8)
        for q in range(1, P):
            ax.axvline(q * E // P, color="grey", lw=0.6)
    ax = axes[-1]
    sends = data["sends"]
    top = max(max(row) for row in sends) or 1
    for src in range(P):
        for dst in range(P):
            n = sends[src][dst]
            ax.add_patch(Rectangle((dst, src), 0.95, 0.95, facecolor=rank_color(dst),
                                   alpha=0.15 + 0.7 * n / top, edgecolor="none"))
            label = f"{n} rows" + (f"\n{n * row_bytes / 1e3:.1f} kB" if row_bytes else "")
            ax.text(dst + 0.47, src + 0.47, label, ha="center", va="center", fontsize=7)
    ax.set_xlim(0, P)
    ax.set_ylim(P, 0)
    ax.set_xticks([q + 0.47 for q in range(P)], [f"to {q}" for q in range(P)], fontsize=7)
    ax.set_yticks([q + 0.47 for q in range(P)], [f"from {q}" for q in range(P)], fontsize=7)
    ax.tick_params(length=0)
    ax.set_title("dispatch all-to-all", fontsize=8)
    handles = [Patch(color=rank_color(q), label=f"an expert held by rank {q}") for q in range(P)]
    handles.append(Patch(facecolor="white", edgecolor="black", label="crossed: dropped"))
    fig.legend(handles=handles, loc="lower center", ncol=P + 1, fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig, data
