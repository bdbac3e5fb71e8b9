"""The course GPT in its tensor-parallel form, and the bytes it communicates.

Where the splits go (Shoeybi et al. 2019, "Megatron-LM", sec. 3, Fig. 3):

* attention: QKV is column-parallel **by heads** (rank r computes heads
  [r nh/t, (r+1) nh/t) of q, k and v; attention is per head, so it runs with
  no communication), the output projection is row-parallel;
* MLP: the up projection (c_fc) column-parallel, GeLU on the slice, the down
  projection (c_proj) row-parallel;
* LayerNorms, residual adds, position embedding: whole on every rank;
* token embedding: vocab-parallel, and the tied LM head uses the same slice,
  so each rank produces logits for its V/t tokens and the loss is the
  vocab-parallel cross-entropy (``helpers.tp.loss``).

Per block that is 2 all-reduces forward (the two ``g``) and 2 backward (the
two ``f``), each of the whole activation: B T h elements. Sec. 3 of the paper
states the 4 per layer; ``tp_comm_bytes`` gives the bytes per layer and
direction, which the counter must reproduce exactly.

Sizes must divide: heads over t (a head is never cut), hence the hidden size,
and the MLP width. Those are errors named by ``tp_plan`` before any rank
starts. The vocabulary is padded instead (Megatron's
``--make-vocab-size-divisible-by``): the extra rows are zero and their logits
are masked to -inf, so padded tokens take no probability and the model equals
the dense one exactly. (Megatron leaves padded logits in the softmax; they
learn to be small.)

Dropout is refused: inside the split region each rank needs its own random
stream (Megatron's ``CudaRNGStatesTracker``), outside it the same one; this
course model's comparisons use dropout 0.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

from helpers.model import GPT, Block, CausalSelfAttention, GPTConfig
from helpers.tp.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                               padded_vocab_size, shard, unshard)
from helpers.tp.loss import vocab_parallel_cross_entropy
from helpers.tp.operators import tp_size
from helpers.validate import positive_int

__all__ = ["TPPlan", "tp_plan", "ParallelSelfAttention", "tensor_parallel_block", "torch_tp_block",
           "TensorParallelGPT", "tensor_parallel_gpt", "tied_lm_head", "gather_dense",
           "tp_comm_bytes"]


@dataclasses.dataclass(frozen=True)
class TPPlan:
    """What each of t ranks holds of a GPT config."""
    t: int
    heads: int         # attention heads per rank
    hidden: int        # q (or k, v) features per rank = heads * head_dim
    mlp: int           # MLP hidden features per rank
    vocab_padded: int  # whole vocabulary after padding
    vocab: int         # vocabulary rows per rank


def tp_plan(cfg: GPTConfig, t: int, vocab_divisible_by: int = 1) -> TPPlan:
    """Validate that ``cfg`` splits over t ranks; raise ValueError naming the constraint.

    Pure: call it before launching ranks.
    """
    positive_int("tensor-parallel size", t)
    if cfg.n_head % t:
        raise ValueError(f"{cfg.n_head} heads do not divide over tensor-parallel size {t}")
    if cfg.n_embd % t:  # implied by the heads (n_embd = n_head * head_dim), kept for clarity
        raise ValueError(f"hidden size {cfg.n_embd} does not divide over tensor-parallel size {t}")
    width = cfg.mlp_ratio * cfg.n_embd
    if width % t:
        raise ValueError(f"MLP width {width} does not divide over tensor-parallel size {t}")
    if cfg.dropout:
        raise ValueError(f"dropout={cfg.dropout}: the tensor-parallel GPT here needs dropout 0 "
                         f"(a split region needs its own random stream per rank)")
    v = padded_vocab_size(cfg.vocab_size, t, vocab_divisible_by)
    return TPPlan(t, cfg.n_head // t, cfg.n_embd // t, width // t, v, v // t)


class ParallelSelfAttention(CausalSelfAttention):
    """This rank's heads: QKV column-parallel in 3 parts, output projection row-parallel.

    x: (B, T, h) whole -> (B, T, h) whole (after c_proj's all-reduce).
    ``core`` (scores, mask, softmax, weighted sum) is the dense model's, on nh/t heads.
    """

    def __init__(self, dense: CausalSelfAttention, group=None,
                 c_attn: nn.Module | None = None, c_proj: nn.Module | None = None):
        nn.Module.__init__(self)
        t = tp_size(group)
        if dense.n_head % t:
            raise ValueError(f"{dense.n_head} heads do not divide over tensor-parallel size {t}")
        self.n_head, self.head_dim = dense.n_head // t, dense.head_dim
        # (c_attn, c_proj given: already-split layers, e.g. PyTorch's, see torch_tp_block)
        self.c_attn = c_attn or ColumnParallelLinear.from_dense(dense.c_attn, group, parts=3)
        self.c_proj = c_proj or RowParallelLinear.from_dense(dense.c_proj, group)
        self.attn_dropout = copy.deepcopy(dense.attn_dropout)
        self.resid_dropout = copy.deepcopy(dense.resid_dropout)
        self.use_sdpa = dense.use_sdpa

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        local = self.n_head * self.head_dim                        # h / t
        q, k, v = self.c_attn(x).split(local, dim=2)               # (B, T, h/t) each
        q, k, v = (u.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for u in (q, k, v))
        y = self.core(q, k, v).transpose(1, 2).reshape(B, T, local)  # (B, T, h/t)
        return self.resid_dropout(self.c_proj(y))


def tensor_parallel_block(block: Block, group=None) -> Block:
    """A copy of ``block`` with attention and MLP split over ``group``; LayerNorms whole."""
    tp = copy.deepcopy(block)
    tp.attn = ParallelSelfAttention(block.attn, group)
    tp.mlp.c_fc = ColumnParallelLinear.from_dense(block.mlp.c_fc, group)
    tp.mlp.c_proj = RowParallelLinear.from_dense(block.mlp.c_proj, group)
    _name_layers(tp)
    return tp


def _name_layers(model: nn.Module) -> None:
    """Each split layer's name for the collective counter: its path in ``model``."""
    for name, module in model.named_modules():
        if hasattr(module, "layout"):
            module.name = name


def tied_lm_head(wte: VocabParallelEmbedding, group=None) -> ColumnParallelLinear:
    """The LM head tied to a vocab-parallel embedding, as the dense GPT ties ``lm_head``
    to ``wte`` (Press & Wolf 2017; Megatron-LM's shared embedding and output weight).

    A column-parallel linear over the (padded) vocabulary, no bias, whose weight
    *is* ``wte.weight``: rank r's rows [vocab_start, vocab_start + V_pad/t), one
    tensor with both uses' gradients. Its logits stay split, (..., V_pad/t), for
    ``vocab_parallel_cross_entropy``. ``TensorParallelGPT`` uses it, and so does
    ``helpers.parallel3d`` for a pipeline stage that holds both ends of the model.
    """
    head = ColumnParallelLinear(wte.embedding_dim, wte.padded_num_embeddings, bias=False,
                                group=group, weight=wte.weight)
    head.name = "lm_head"  # for the collective counter (TensorParallelGPT names it by path)
    return head


class TensorParallelGPT(nn.Module):
    """The course GPT over a tensor-parallel group, with the dense model's parameter names.

    ``forward(idx, targets)`` -> (logits slice (B, T, V_pad/t), mean loss or None).
    """

    def __init__(self, dense: GPT, group=None, vocab_divisible_by: int = 1):
        super().__init__()
        cfg = dense.config
        self.config, self.group = cfg, group
        self.plan = tp_plan(cfg, tp_size(group), vocab_divisible_by)
        self.wte = VocabParallelEmbedding.from_dense(dense.wte, group, self.plan.vocab_padded)
        self.wpe = copy.deepcopy(dense.wpe)
        self.drop = copy.deepcopy(dense.drop)
        self.blocks = nn.ModuleList(tensor_parallel_block(b, group) for b in dense.blocks)
        self.ln_f = copy.deepcopy(dense.ln_f)
        # Tied head: a column-parallel linear whose weight *is* the embedding slice.
        self.lm_head = tied_lm_head(self.wte, group)
        _name_layers(self)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, h), whole on every rank

    def head(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.ln_f(x))  # (B, T, V_pad/t)
        # Padded vocabulary rows get -inf: no probability, no gradient.
        start = self.wte.vocab_start
        ids = torch.arange(start, start + logits.size(-1), device=logits.device)
        return logits.masked_fill(ids >= self.config.vocab_size, float("-inf"))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        if targets is None:
            return logits, None
        return logits, vocab_parallel_cross_entropy(logits, targets, self.group,
                                                    vocab_start=self.wte.vocab_start)


def torch_tp_block(block: Block, group=None) -> Block:
    """The same split with PyTorch's DTensor TP (``parallelize_module`` with
    ``ColwiseParallel`` / ``RowwiseParallel``, as torchtitan's ``apply_tp``), to compare.

    ``ColwiseParallel`` gives rank r a contiguous slice of c_attn's 3h rows, so
    the rows are first reordered [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (q_r: rank
    r's heads of q); ``attn.qkv_perm`` records the order. Attention then runs
    on its local heads, as in ``ParallelSelfAttention``.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    t = tp_size(group)
    rows = torch.arange(block.attn.c_attn.out_features, device=block.attn.c_attn.weight.device)
    perm = torch.cat([shard(rows, 0, t, r, parts=3) for r in range(t)])  # rank-major q, k, v
    c_attn = copy.deepcopy(block.attn.c_attn)
    with torch.no_grad():
        c_attn.weight.copy_(block.attn.c_attn.weight[perm])
        if c_attn.bias is not None:
            c_attn.bias.copy_(block.attn.c_attn.bias[perm])
    tp = copy.deepcopy(block)
    tp.attn = ParallelSelfAttention(block.attn, group, c_attn=c_attn,
                                    c_proj=copy.deepcopy(block.attn.c_proj))
    tp.attn.qkv_perm = perm
    mesh = DeviceMesh.from_group(group or dist.group.WORLD, block.ln_1.weight.device.type)
    plan = {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()}
    return parallelize_module(tp, mesh, plan)


def tensor_parallel_gpt(model: GPT, group=None, vocab_divisible_by: int = 1) -> TensorParallelGPT:
    """The tensor-parallel form of ``model`` over ``group`` (None: the default group).

    Weights are copied from ``model`` (which must be the same on every rank),
    so the two can be compared; ``model`` itself is left untouched.
    """
    return TensorParallelGPT(model, group, vocab_divisible_by)


def gather_dense(tp_model: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) of a TP model, whole, named as in the dense model.

    A collective: every rank of the group must call it. Uses plain all-gathers
    (not counted: this is for checking, not training).
    """
    out = {}
    owners = {}
    for mod_name, module in tp_model.named_modules():
        for p_name, spec in getattr(module, "layout", {}).items():
            owners[f"{mod_name}.{p_name}" if mod_name else p_name] = (module, spec)
    for name, p in tp_model.named_parameters():
        value = p.grad if grads else p.detach()
        if value is None:
            out[name] = None
            continue
        module, spec = owners.get(name, (None, None))
        if spec is None:  # replicated: the same on every rank
            out[name] = value.clone()
            continue
        t = tp_size(module.group)
        parts = [value]
        if t > 1:
            parts = [torch.empty_like(value) for _ in range(t)]
            dist.all_gather(parts, value.contiguous(), group=module.group)
        full = unshard(parts, *spec)
        if isinstance(module, VocabParallelEmbedding):
            full = full[:module.num_embeddings]  # drop the padding
        out[name] = full.clone()
    return out


def tp_comm_bytes(cfg: GPTConfig, batch: int, seq: int, t: int,
                  dtype_bytes: int = 4) -> dict[tuple[str, str], int]:
    """Payload bytes each rank all-reduces, per (layer, direction), for one step.

    Every all-reduce carries a whole activation (batch, seq, n_embd)
    (Shoeybi et al. 2019, sec. 3): per block 2 forward (after attention's and
    the MLP's row-parallel layer) and 2 backward (before their column-parallel
    layers); the vocab-parallel embedding 1 forward; the tied head 1 backward;
    the loss 3 of (batch, seq) values forward (max, target logit, sum of exp).
    All zero when t = 1 (nothing to reduce). Layer names as in TensorParallelGPT.
    """
    if t == 1:
        return {}
    act = batch * seq * cfg.n_embd * dtype_bytes
    out = {("wte", "forward"): act}
    for i in range(cfg.n_layer):
        for part in ("attn.c_proj", "mlp.c_proj"):
            out[(f"blocks.{i}.{part}", "forward")] = act
        for part in ("attn.c_attn", "mlp.c_fc"):
            out[(f"blocks.{i}.{part}", "backward")] = act
    out[("lm_head", "backward")] = act
    out[("loss", "forward")] = 3 * batch * seq * dtype_bytes
    return out
