"""A parallel layout as a picture: which GPU of which node holds which slice of the model.

Chapter 19 reads a framework's configuration into a ``Plan`` and chapter 20's planner
picks a ``Layout``; both are degrees, dp x tp x pp (x cp), and a rank order. The order
is Megatron-LM's (``helpers.mesh.MEGATRON_DIMS``): tp varies fastest, then cp, then dp,
and pp slowest, and a job fills its nodes with consecutive ranks. That one convention
decides where every group lands, which is what the cost model prices:

* a TP group is ``tp`` consecutive ranks, so with tp <= GPUs per node it sits inside one
  node, on NVLink (chapter 09's rule: its four all-reduces per layer wait for it);
* a pipeline stage is a block of ``dp x cp x tp`` consecutive ranks, whole nodes when it
  is at least one node, so the stage boundary is a hop between nodes (chapter 11);
* a DP (or CP) group takes one rank every ``tp`` (``tp x cp``) ranks: spread over the
  nodes of its stage, each member on another node when tp fills a node (chapter 07: a
  strided ring owns one NIC per node).

``draw_rank_grid(layout, gpus_per_node)`` draws the GPUs as the cluster holds them, one
row per node, each GPU coloured by its pipeline stage and labelled with its rank and its
dp (and cp) coordinate; each TP group is outlined. Every coordinate comes from
``helpers.mesh.coords_of``, the function the planner and the cost model place groups with,
so the picture is the placement the numbers were computed for. Given the busiest GPU's
memory terms (the planner's ``Candidate.memory``, chapter 19's ``Estimate.memory``) it
adds a bar of them against the GPU's memory. A large job is drawn by its first nodes
(``max_nodes``): the pattern repeats.

How production differs: Megatron-LM builds these groups with
``parallel_state.initialize_model_parallel`` from the same order (its ``order`` string,
"tp-cp-ep-dp-pp" by default); torchtitan names the dims of one ``DeviceMesh``; Llama 3
orders them [TP, CP, PP, DP] (Dubey et al. 2024, Figure 5), so there DP, not PP, is the
outermost axis. Changing the order changes which link each axis's collectives cross.
"""

from __future__ import annotations

from typing import Any

from helpers.drawing import rank_color
from helpers.mesh import MEGATRON_DIMS, axis_groups, coords_of

__all__ = ["layout_sizes", "layout_cells", "draw_rank_grid"]

_AXES = ("tp", "cp", "dp", "pp")


def layout_sizes(layout: Any) -> dict[str, int]:
    """{axis: degree} of a ``Layout``, a ``Plan`` or anything with dp, tp, pp (and cp)."""
    return {axis: int(getattr(layout, axis, 1) or 1) for axis in _AXES}


def layout_cells(layout: Any, gpus_per_node: int, max_nodes: int | None = None) -> list[dict]:
    """One dict per GPU of the first ``max_nodes`` nodes (all, if None): its rank, node,
    GPU index in the node and coordinate on every axis, in rank order."""
    sizes = layout_sizes(layout)
    world = sizes["tp"] * sizes["cp"] * sizes["dp"] * sizes["pp"]
    shown = world if max_nodes is None else min(world, max_nodes * gpus_per_node)
    return [{"rank": r, "node": r // gpus_per_node, "gpu": r % gpus_per_node,
             **coords_of(r, MEGATRON_DIMS, sizes)} for r in range(shown)]


def draw_rank_grid(layout: Any, gpus_per_node: int, *, memory: dict | None = None,
                   gpu_memory: float | None = None, usable: float | None = None,
                   max_nodes: int = 10, title: str | None = None):
    """Draw ``layout``'s GPUs node by node (see the module docstring); returns (fig, data).

    ``memory``: {term: bytes} of the busiest GPU (pipeline stage 0), drawn as one stacked
    bar beside the grid, with ``gpu_memory`` (and ``usable``, the planner's budget) as
    lines. ``data``: ``sizes``, ``cells`` (``layout_cells``), ``groups`` ({axis: the
    groups of that axis among the drawn ranks, as ``helpers.mesh.axis_groups`` gives
    them}), ``nodes`` (drawn, of all), ``memory`` (bytes, as given)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    sizes = layout_sizes(layout)
    world = sizes["tp"] * sizes["cp"] * sizes["dp"] * sizes["pp"]
    cells = layout_cells(layout, gpus_per_node, max_nodes)
    shown = {c["rank"] for c in cells}
    nodes = -(-world // gpus_per_node)
    drawn_nodes = -(-len(cells) // gpus_per_node)
    groups = {axis: [g for g in axis_groups(axis, MEGATRON_DIMS, sizes) if set(g) <= shown]
              for axis in _AXES if sizes[axis] > 1}

    if memory:
        fig, (grid, bar) = plt.subplots(
            1, 2, figsize=(0.62 * gpus_per_node + 2.6, 1.3 + 0.42 * drawn_nodes),
            gridspec_kw={"width_ratios": [gpus_per_node, 1.6]})
    else:
        fig, grid = plt.subplots(figsize=(0.62 * gpus_per_node + 1.0, 1.3 + 0.42 * drawn_nodes))
    for c in cells:
        x, y = c["gpu"], c["node"]
        grid.add_patch(Rectangle((x, y), 0.94, 0.9, facecolor=rank_color(c["pp"]), alpha=0.55,
                                 edgecolor="white"))
        label = f"{c['rank']}\ndp{c['dp']}" + (f" cp{c['cp']}" if sizes["cp"] > 1 else "")
        grid.text(x + 0.47, y + 0.45, label, ha="center", va="center", fontsize=6.5)
    for g in groups.get("tp", []):   # consecutive ranks of one node: one outline each
        first = next(c for c in cells if c["rank"] == g[0])
        grid.add_patch(Rectangle((first["gpu"] - 0.02, first["node"] - 0.03), len(g) - 0.02,
                                 0.96, fill=False, edgecolor="black", lw=1.4))
    grid.set_xlim(-0.1, gpus_per_node)
    grid.set_ylim(drawn_nodes, -0.1)
    grid.set_xticks([i + 0.47 for i in range(gpus_per_node)], range(gpus_per_node))
    grid.set_yticks([n + 0.45 for n in range(drawn_nodes)],
                    [f"node {n}" for n in range(drawn_nodes)])
    grid.tick_params(length=0, labelsize=7)
    grid.set_xlabel("GPU in its node (label: rank, data-parallel index)", fontsize=8)
    for side in grid.spines.values():
        side.set_visible(False)
    stages = sorted({c["pp"] for c in cells})
    handles = [Patch(facecolor=rank_color(s), alpha=0.55, label=f"pipeline stage {s}")
               for s in stages]
    if "tp" in groups:
        handles.append(Patch(facecolor="none", edgecolor="black", label="one TP group"))
    grid.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 1.0),
                ncol=min(4, len(handles)), fontsize=7, frameon=False)
    degrees = " x ".join(f"{a.upper()} {sizes[a]}" for a in ("dp", "cp", "tp", "pp")
                         if sizes[a] > 1 or a in ("dp", "tp", "pp"))
    more = f"; nodes 0-{drawn_nodes - 1} of {nodes} drawn" if drawn_nodes < nodes else ""
    fig.suptitle(title or f"{degrees} on {world} GPUs ({gpus_per_node} per node{more})",
                 fontsize=9)

    if memory:
        bottom = 0.0
        for i, (name, value) in enumerate(memory.items()):
            if value:
                bar.bar(0, value / 1e9, bottom=bottom, color=f"C{i}", label=name, width=0.6)
                bottom += value / 1e9
        for line, style, name in ((gpu_memory, "-", "GPU"), (usable, "--", "usable")):
            if line:
                bar.axhline(line / 1e9, color="black", ls=style, lw=1, label=name)
        bar.set_xticks([])
        bar.set_xlim(-0.6, 0.6)
        bar.set_ylabel("GB on the busiest GPU", fontsize=8)
        bar.tick_params(labelsize=7)
        bar.set_ylim(0, max(bottom, (gpu_memory or 0) / 1e9) * 1.1)
        bar.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    fig.tight_layout()
    data = {"sizes": sizes, "cells": cells, "groups": groups,
            "nodes": (drawn_nodes, nodes), "memory": dict(memory or {})}
    return fig, data
