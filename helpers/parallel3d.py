"""3-D parallelism: data x tensor x pipeline parallel training of the course GPT.

What
----
Each axis of the course so far answers one limit. Data parallelism (ch. 02-04)
multiplies throughput but copies the whole model; tensor parallelism (ch. 08-09)
splits each layer's matrices so a layer fits; pipeline parallelism (ch. 11-12)
cuts the model by depth so the stack fits. Large runs use all three at once
(Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", SC21, sec. 2 and 3): ``dp * tp * pp`` ranks,
every rank holding one TP shard of one pipeline stage of one replica.

This module composes the course's own pieces, nothing new inside them:

1. ``build_mesh``: the rank grid from ``torch.distributed.device_mesh.init_device_mesh``,
   one process group per axis.
2. ``split_model`` (helpers.pipeline.executor): the GPT cut into ``pp`` stages.
3. ``apply_tp``: inside each stage, attention and MLP split over the TP group with
   ``ColumnParallelLinear`` / ``RowParallelLinear`` (helpers.tp), the embedding
   and the tied LM head vocab-parallel, the loss ``vocab_parallel_cross_entropy``.
4. ``pipeline_step`` (helpers.pipeline.executor): 1F1B or GPipe over the PP
   group, m micro-batches; the tied embedding / head gradients added between
   the first and last stage.
5. ``sync_data_parallel``: the gradients averaged over the DP group in one flat
   bucket (``helpers.ddp.allreduce_hook``, DDP's default hook).
6. The optimizer step, on each rank's own shard (SGD is element-wise, so a
   sharded step equals the dense one).

The order is torchtitan's (``parallelize_llama``: pipeline split, then TP on each
stage, then data parallelism around it), and every rank runs the same code.

Rank layout
-----------
The mesh's last dimension varies fastest: consecutive ranks differ in it. On
a real cluster consecutive ranks share a node, so the innermost axis gets the
NVLink. TP all-reduces whole activations 4 times per block on the critical
path (ch. 09), PP sends one activation per micro-batch per stage boundary, DP
all-reduces the gradients once per step (overlappable): so TP goes innermost
(Narayanan et al. 2021, sec. 3.3, Takeaway #1: tensor parallelism up to the
GPUs of one server, pipeline parallelism across servers). Megatron-LM's rank
order "tp-cp-ep-dp-pp" (fastest first) and torchtitan's mesh ("pp",
"dp_replicate", "dp_shard", "cp", "tp") both put TP fastest and PP slowest;
here DP is the outermost axis (the mesh's first name). On one 8-rank node
that changes nothing; on a cluster it decides whether the slowest link
carries DP's once-per-step all-reduce or PP's activations. With dp = tp = pp = 2:

    mesh (dp, pp, tp), the default        mesh (dp, tp, pp)
    rank  dp pp tp                         rank  dp tp pp
      0    0  0  0                           0    0  0  0
      1    0  0  1                           1    0  0  1
      2    0  1  0                           2    0  1  0
      3    0  1  1                           3    0  1  1
      4    1  0  0                           4    1  0  0
      ...                                    ...
    TP groups {0,1} {2,3} {4,5} {6,7}      TP groups {0,2} {1,3} {4,6} {5,7}
    PP groups {0,2} {1,3} {4,6} {5,7}      PP groups {0,1} {2,3} {4,5} {6,7}
    DP groups {0,4} {1,5} {2,6} {3,7}      DP groups {0,4} {1,5} {2,6} {3,7}

``tp_innermost=False`` builds ``init_device_mesh(dev, (dp, tp, pp),
mesh_dim_names=("dp", "tp", "pp"))``: the pipeline neighbours become adjacent
and every TP all-reduce would cross a node boundary as soon as a node holds
fewer than tp * pp ranks. The numbers are the same either way (the tests check);
only which link carries which traffic changes.

What each rank communicates per step (b = micro-batch, T tokens, h width):
TP: 4 all-reduces of (b, T, h) per block per micro-batch (2 forward, 2
backward), 1 for the embedding, 1 for the head, 3 small ones for the loss;
PP: 1 send of (b, T, h) forward and 1 backward per micro-batch per stage
boundary, plus the tied weight's gradient between the first and last stage;
DP: 1 all-reduce of this rank's gradients, about 1/(tp*pp) of the model's.

Cost
----
Memory per rank: about 1/(tp*pp) of the weights, gradients and optimizer
state (the LayerNorms, position embedding and row-parallel biases stay whole
in each stage). Idle time: the pipeline bubble (p-1)/(m+p-1) of GPipe/1F1B
(ch. 12), plus exposed TP all-reduces, plus the DP all-reduce (here after
backward, not overlapped). Communication is what the layout decides.

How production differs
----------------------
Megatron-LM overlaps the DP reduce with backward and shards the optimizer over
DP (distributed optimizer, ch. 14), adds sequence parallelism to TP (ch. 10)
and interleaved stages (ch. 12); torchtitan builds the same mesh and applies
PyTorch's ``pipelining``, DTensor TP and FSDP2 in that order. The optimizer
here is plain SGD: Adam's first step is about lr * sign(g), which turns a
rounding-level difference in a near-zero gradient into a whole lr, so the
comparison with one process would no longer be a matter of float32 noise.
"""

from __future__ import annotations

import dataclasses
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from helpers.clock import clock_for, elapsed
from helpers.data import make_dataset
from helpers.ddp import allreduce_hook
from helpers.launch import launch, rank_info
from helpers.mesh import rank_coords
from helpers.model import GPTConfig, build_model
from helpers.pipeline.executor import StageChunk, pipeline_step, split_model
from helpers.pipeline.schedules import gpipe, one_f_one_b
from helpers.tolerance import NOISE_FACTOR, fp32_noise, max_abs
from helpers.tp import (ColumnParallelLinear, VocabParallelEmbedding, gather_dense,
                        tensor_parallel_block, tied_lm_head, tp_plan,
                        vocab_parallel_cross_entropy)
from helpers.validate import positive_int

__all__ = ["run_capstone", "CapstoneResult", "CapstoneLayout", "build_mesh", "apply_tp",
           "sync_data_parallel", "sgd_step", "train_3d", "reference_run", "capstone_batches",
           "rank_table"]

SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}
OMIT = (None, "dp", "tp", "tied")  # what a broken run may leave out (tests, experiments)


@dataclasses.dataclass
class CapstoneLayout:
    """The 3-D layout of one capstone run (mesh sizes, model, batch, schedule), validated
    before any rank starts. (``helpers.planner.Layout`` is another thing: a layout of a
    large model that chapter 20's planner costs on paper.)"""

    dp: int = 2
    tp: int = 2
    pp: int = 2
    size: str = "toy"           # a helpers.model size; its n_layer / n_head must divide
    n_layer: int | None = None  # None: the size's own depth
    batch: int = 8              # global batch (sequences), split dp ways, then m micro-batches
    seq: int = 16
    micro_batches: int = 2
    schedule: str = "1f1b"
    steps: int = 3
    lr: float = 0.5
    tp_innermost: bool = True

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "batch", "seq", "micro_batches", "steps"):
            positive_int(name, getattr(self, name))
        cfg = self.config  # unknown size, bad n_layer: ValueError from GPTConfig
        t, p = self.tp, self.pp
        tp_plan(cfg, t)  # "4 heads do not divide over tensor-parallel size 3", MLP width
        if cfg.vocab_size % t:
            raise ValueError(f"a vocabulary of {cfg.vocab_size} does not divide over "
                             f"tensor-parallel size {t} (the vocab-parallel head needs equal "
                             f"slices)")
        if cfg.n_layer % p:
            raise ValueError(f"{cfg.n_layer} layers do not divide over pipeline size {p}: "
                             f"every stage gets n_layer / pp blocks")
        if self.batch % (self.dp * self.micro_batches):
            raise ValueError(f"global batch {self.batch} does not divide into dp={self.dp} "
                             f"replicas x {self.micro_batches} micro-batches")
        if self.seq > cfg.block_size:
            raise ValueError(f"seq={self.seq} exceeds block_size={cfg.block_size} of size "
                             f"{self.size!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got "
                             f"{self.schedule!r}")
        env = os.environ.get("WORLD_SIZE")
        if env is not None and "RANK" in os.environ and int(env) != self.world_size:
            raise ValueError(f"dp x tp x pp = {self.dp} x {self.tp} x {self.pp} = "
                             f"{self.world_size} ranks, but torchrun started WORLD_SIZE={env}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def config(self) -> GPTConfig:
        extra = {} if self.n_layer is None else {"n_layer": self.n_layer}
        return GPTConfig.from_name(self.size, **extra)

    @property
    def mesh_dims(self) -> tuple[str, str, str]:
        return ("dp", "pp", "tp") if self.tp_innermost else ("dp", "tp", "pp")


def rank_table(layout: CapstoneLayout) -> list[dict[str, int]]:
    """Each global rank's coordinate on every axis, as ``init_device_mesh`` lays
    them out: the mesh is ``arange(world).view(shape)`` (last name fastest;
    ``helpers.mesh.rank_coords``, the course's one rank-order rule). A pure
    function, so the layout can be printed without starting ranks."""
    sizes = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp}
    return [{"rank": rank, **{n: c[n] for n in ("dp", "tp", "pp")}}
            for rank, c in enumerate(rank_coords(layout.mesh_dims, sizes))]


def capstone_batches(layout: CapstoneLayout,
                     seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batch (x, y) of every step, (batch, seq) int64 each: the course's
    Markov language (helpers.data), identical on every rank and in the reference."""
    cfg = layout.config
    data = make_dataset(cfg.vocab_size, layout.seq, layout.batch * layout.steps, seed)
    return [data.batch(range(s * layout.batch, (s + 1) * layout.batch))
            for s in range(layout.steps)]


# --------------------------------------------------------------------------
# The parts, applied in order on every rank.
# --------------------------------------------------------------------------

def build_mesh(layout: CapstoneLayout, device_type: str = "cpu"):
    """The (dp, pp, tp) mesh (or (dp, tp, pp)) and its three process groups."""
    from torch.distributed.device_mesh import init_device_mesh

    sizes = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp}
    names = layout.mesh_dims
    mesh = init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=names)
    groups = {n: mesh[n].get_group() for n in ("dp", "tp", "pp")}
    return mesh, groups


def apply_tp(chunk: StageChunk, group) -> StageChunk:
    """Split one pipeline stage's layers over the TP ``group``, in place.

    Blocks: attention by heads and the MLP by columns/rows (``tensor_parallel_block``,
    ch. 09). First stage: the token embedding vocab-parallel. Last stage: the LM
    head column-parallel over the vocabulary, its logits left split for
    ``vocab_parallel_cross_entropy``. Rank r of the group holds vocabulary rows
    [r V/t, (r+1) V/t) in both, so the tied weight's two copies (first and last
    stage) stay shard-for-shard the same tensor.
    """
    chunk.blocks = nn.ModuleList(tensor_parallel_block(b, group) for b in chunk.blocks)
    if chunk.first:
        chunk.wte = VocabParallelEmbedding.from_dense(chunk.wte, group)
    if chunk.last:
        if chunk.first:  # one stage holds both uses: keep them one tensor
            chunk.lm_head = tied_lm_head(chunk.wte, group)
        else:
            chunk.lm_head = ColumnParallelLinear.from_dense(chunk.lm_head, group)  # (V/t, h)
        chunk.vocab_start = chunk.lm_head.weight.size(0) * dist.get_rank(group)
    return chunk


def sync_data_parallel(params: list[nn.Parameter], group) -> None:
    """Average the gradients over the DP ``group`` in one flat bucket.

    All of this rank's gradients (its shard of its stage, 1/(tp*pp) of the
    model) are packed into one buffer, all-reduced with DDP's default hook
    (divide by dp, sum; ``helpers.ddp.allreduce_hook``) and copied back: one
    collective instead of one per parameter (ch. 04's bucket, here a single one).
    """
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    flat = allreduce_hook(flat, group).wait()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


@torch.no_grad()
def sgd_step(params: list[nn.Parameter], lr: float) -> None:
    """p <- p - lr * grad: what ``torch.optim.SGD(params, lr)`` does without momentum
    (the same ``add_`` per parameter, so the same bits). Written out because the
    first ``torch.optim`` step in a process imports ``torch._dynamo`` (seconds of
    CPU per rank, more than this whole run on the tiny model)."""
    for p in params:
        p.add_(p.grad, alpha=-lr)


def train_3d(layout: CapstoneLayout, seed: int = 0, omit: str | None = None) -> dict:
    """Rank function (under ``launch``): ``layout.steps`` SGD steps of the 3-D run.

    Returns this rank's mesh coordinate, per-step losses (on the last stage),
    per-step times, and the step-1 gradients of its stage gathered whole over
    TP, under the dense model's names (from TP rank 0 of DP replica 0 only).
    ``omit``: "dp" skips the DP average, "tied" the tied-weight exchange,
    "tp" Megatron's f in every column-parallel layer (its backward all-reduce).
    """
    info = rank_info()
    device = torch.device(info.device)
    mesh, groups = build_mesh(layout, device.type)
    coord = dict(zip(layout.mesh_dims, mesh.get_coordinate()))
    d, s, t = coord["dp"], coord["pp"], coord["tp"]

    model = build_model(layout.config, seed=seed)  # the same weights on every rank
    chunk = split_model(model, layout.pp)[s][0]    # this rank's stage (one chunk: no interleave)
    apply_tp(chunk, groups["tp"])
    chunk.to(device)
    if omit == "tp":  # Megatron's f left out: forward the same, dL/dx stays partial
        for m in chunk.modules():
            if isinstance(m, ColumnParallelLinear):
                m.forward = lambda x, m=m: F.linear(x, m.weight, m.bias)
    params = list(chunk.parameters())
    schedule = SCHEDULES[layout.schedule](layout.pp, layout.micro_batches)
    vocab_start = getattr(chunk, "vocab_start", 0)

    def loss_fn(logits, y):  # logits (b, T, V/t), this rank's vocabulary slice
        return vocab_parallel_cross_entropy(logits, y, groups["tp"], vocab_start=vocab_start)

    clk = clock_for(device)
    shard = layout.batch // layout.dp  # replica d takes rows [d*shard, (d+1)*shard)
    losses, times, grads = [], [], None
    for step, (x, y) in enumerate(capstone_batches(layout, seed)):
        x, y = (u[d * shard:(d + 1) * shard].to(device) for u in (x, y))
        t0 = clk.mark()
        for p in params:  # pipeline_step accumulates into .grad: zeros, not None
            p.grad = torch.zeros_like(p)
        res = pipeline_step([chunk], schedule, x, y, group=groups["pp"], loss_fn=loss_fn,
                            sync_tied=omit != "tied", measure_stash=False)
        if omit != "dp":
            sync_data_parallel(params, groups["dp"])
        sgd_step(params, layout.lr)
        times.append(elapsed(t0, clk.mark()))  # on a GPU: when its queued work finished
        losses.append(res.loss)
        if step == 0:  # the step leaves .grad as it was: gather after the timed step
            whole = gather_dense(chunk, grads=True)  # collective over the TP group
            if d == 0 and t == 0:
                names = chunk.global_names()
                grads = [(names[n], g.cpu()) for n, g in whole.items() if g is not None]
    return {"coord": coord, "losses": losses, "times": times, "grads": grads}


# --------------------------------------------------------------------------
# The single-process reference and the driver.
# --------------------------------------------------------------------------

def reference_run(layout: CapstoneLayout, seed: int = 0,
                  dtype: torch.dtype = torch.float32) -> tuple[list[float], dict, list[float]]:
    """The same model, data and SGD steps on one process, whole batch at once.
    Returns per-step losses, the step-1 gradients by name and per-step times."""
    model = build_model(layout.config, seed=seed).to(dtype)
    losses, grads, times = [], {}, []
    clk = clock_for(next(model.parameters()).device)
    for step, (x, y) in enumerate(capstone_batches(layout, seed)):
        t0 = clk.mark()
        model.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        sgd_step(list(model.parameters()), layout.lr)
        times.append(elapsed(t0, clk.mark()))
        losses.append(float(loss.detach()))
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return losses, grads, times


@dataclasses.dataclass
class CapstoneResult:
    losses: list[float]             # per step, the 3-D run (mean over DP replicas)
    reference_losses: list[float]   # per step, one process, float32
    max_grad_diff: float            # max |grad_3d - grad_ref64| over all parameters, step 1
    bound: float                    # NOISE_FACTOR x the float32 reference's own noise
    loss_diff: float                # max over steps |loss_3d - loss_ref64|
    loss_bound: float               # the same kind of bound, for the losses
    mesh_dims: tuple[str, ...]      # names given to init_device_mesh, slowest first
    step_time_s: float              # mean step time (slowest rank), after the first step
    step_times_s: list[float]       # every step's time (slowest rank), the first included
    reference_step_time_s: float    # the same for the single-process float32 run
    layout: CapstoneLayout
    ranks: list[dict]               # each rank's mesh coordinate, as the run reported it

    @property
    def ok(self) -> bool:
        return self.max_grad_diff <= self.bound and self.loss_diff <= self.loss_bound

    def __str__(self) -> str:
        L = self.layout
        lines = [f"dp x tp x pp = {L.dp} x {L.tp} x {L.pp} = {L.world_size} ranks, mesh "
                 f"{self.mesh_dims}, {L.schedule} with {L.micro_batches} micro-batches",
                 f"{'step':>4s} {'loss 3-D':>10s} {'loss 1 proc':>11s} {'|diff|':>9s}"]
        for i, (a, b) in enumerate(zip(self.losses, self.reference_losses)):
            lines.append(f"{i + 1:4d} {a:10.6f} {b:11.6f} {abs(a - b):9.2e}")
        verdict = "within" if self.max_grad_diff <= self.bound else "OUTSIDE"
        lines.append(f"step-1 gradients: max |3-D - float64| {self.max_grad_diff:.2e}, "
                     f"{verdict} the bound {self.bound:.2e}")
        lines.append(f"step time {1e3 * self.step_time_s:.1f} ms (one process, one thread: "
                     f"{1e3 * self.reference_step_time_s:.1f} ms)")
        return "\n".join(lines)

    __repr__ = __str__


def _mean_step_time(per_step: list[float]) -> float:
    return statistics.mean(per_step[1:] if len(per_step) > 1 else per_step)


def run_capstone(dp: int = 2, tp: int = 2, pp: int = 2, steps: int = 3, seed: int = 0, *,
                 micro_batches: int = 2, schedule: str = "1f1b", size: str = "toy",
                 n_layer: int | None = None, batch: int = 8, seq: int = 16, lr: float = 0.5,
                 tp_innermost: bool = True, omit: str | None = None, backend: str = "auto",
                 timeout: float = 120.0) -> CapstoneResult:
    """Train the course GPT ``steps`` SGD steps on dp x tp x pp ranks and on one
    process; compare losses and step-1 gradients.

    The bound: the float32 3-D run adds the same numbers as the float32
    reference in another order (TP partial sums, DP halves, micro-batches), so
    its distance from a float64 rerun must be float32 rounding noise of this
    computation: at most ``NOISE_FACTOR`` x the float32 reference's own distance
    from float64 (helpers.tolerance), measured here, on this machine.
    Every argument is checked (``CapstoneLayout``) before any rank starts.
    """
    if omit not in OMIT:
        raise ValueError(f"omit must be one of {OMIT}, got {omit!r}")
    layout = CapstoneLayout(dp, tp, pp, size, n_layer, batch, seq, micro_batches, schedule,
                            steps, lr, tp_innermost)
    results = launch(train_3d, layout.world_size, layout, seed, omit, backend=backend,
                     timeout=timeout, seed=seed)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs: the tiny model's ops are too small to share
    try:
        ref32_losses, ref32, ref_times = reference_run(layout, seed)
        ref64_losses, ref64, _ = reference_run(layout, seed, torch.float64)
    finally:
        torch.set_num_threads(threads)

    last = [r for r in results if r["coord"]["pp"] == layout.pp - 1 and r["coord"]["tp"] == 0]
    losses = [statistics.fmean(r["losses"][i] for r in last) for i in range(layout.steps)]
    grads = [pair for r in results if r["grads"] for pair in r["grads"]]
    missing = set(ref64) - {name for name, _ in grads}
    if missing:
        raise RuntimeError(f"the 3-D run returned no gradient for {sorted(missing)}")
    max_grad_diff = max(max_abs(g.double() - ref64[n]) for n, g in grads)
    bound = NOISE_FACTOR * max(fp32_noise(ref32[n], ref64[n]) for n in ref64)
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref64_losses))
    loss_bound = NOISE_FACTOR * max(fp32_noise(torch.tensor(a), torch.tensor(b))
                                    for a, b in zip(ref32_losses, ref64_losses))
    step_times = [max(r["times"][i] for r in results) for i in range(layout.steps)]
    return CapstoneResult(losses, ref32_losses, max_grad_diff, bound, loss_diff, loss_bound,
                          layout.mesh_dims, _mean_step_time(step_times), step_times,
                          _mean_step_time(ref_times), layout,
                          [{"rank": i, **{n: r["coord"][n] for n in ("dp", "tp", "pp")}}
                           for i, r in enumerate(results)])
