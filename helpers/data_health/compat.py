"""Checkpoint compatibility: refuse, before a step runs, a checkpoint this job cannot use.

A checkpoint is a set of named tensors. Loading it into a job needs more than
the names to agree: each tensor's shape, its dtype, its layout (which rows mean
what: a fused q/k/v weight stacked as [q; k; v] or interleaved head by head;
which slice of a sharded tensor a rank's file
holds) and the format of the files. (Megatron-LM's fused ``linear_qkv`` is viewed
per query group, ``[sq, b, ng, (np/ng + 2) * hn]``, in megatron-core's
``SelfAttention.get_query_key_value_tensors``: a converter between it and the
stacked layout must permute the rows.) The loaders guard only part of that:

* ``nn.Module.load_state_dict`` (strict) refuses missing or unexpected names and
  other shapes; it copies another dtype in silently (``copy_`` converts);
* DCP's ``DefaultLoadPlanner`` (``torch.distributed.checkpoint``, torch 2.13,
  ``create_default_local_load_plan``) refuses a name the job asks for that the
  checkpoint lacks ("Missing key in checkpoint state_dict") and another size
  ("Size mismatch between saved ... and current"); it ignores names the job
  does not ask for, converts another dtype while copying, and writes its
  ``Metadata.version`` ("1.0.0") without comparing it on load (checked in
  ``filesystem.py`` and ``default_planner.py`` of torch 2.13);
* the course's store (``helpers.checkpoint.store.load_latest`` with ``like=``)
  refuses another shape; a manifest of another format version is *skipped*,
  with the reason in ``Loaded.skipped``, and if no checkpoint is left the job
  starts from its fresh weights.

None of them can see a layout: a tensor of the same name, shape and dtype whose
rows mean something else loads without a word, and training continues from
wrong weights. Changing ``n_head`` at a fixed width does exactly that: every
shape stays the same, and the heads cut ``c_attn``'s rows elsewhere.

The guard here compares a *signature*: for every tensor its name, shape, dtype
and a layout tag, plus the signature's format version. ``signature`` builds it
for a model (``model_layouts`` tags the course GPT's tensors); it is saved with
the checkpoint as plain values; ``store_signature`` and ``dcp_signature`` read it
back (names, shapes and dtypes from the checkpoint's own metadata, the manifest
or DCP's ``.metadata``, so the files are not loaded); ``require_compatible``
raises ``IncompatibleCheckpoint`` listing every mismatch by name. Cost: reading
one metadata file, before any weight is read.
"""

from __future__ import annotations

import json
import os

import torch

from helpers.checkpoint.store import FORMAT as STORE_FORMAT

__all__ = ["SIGNATURE_FORMAT", "IncompatibleCheckpoint", "signature", "model_layouts",
           "compare", "require_compatible", "store_signature", "dcp_signature",
           "qkv_per_head", "qkv_stacked"]

SIGNATURE_FORMAT = 1


class IncompatibleCheckpoint(ValueError):
    """The checkpoint does not fit this job; the message lists each mismatch."""


def model_layouts(model) -> dict[str, str]:
    """Layout tag of each tensor of the course GPT: its fused q/k/v weight and bias are
    stacked [q; k; v] and cut into ``n_head`` heads; every other tensor is plain."""
    n_head = model.config.n_head
    return {name: (f"qkv stacked, {n_head} heads" if ".c_attn." in name else "plain")
            for name in model.state_dict()}


def signature(state, layouts: dict[str, str] | None = None,
              format_version: int = SIGNATURE_FORMAT) -> dict:
    """``{"format": v, "tensors": {name: {"shape", "dtype", "layout"}}}`` of a state dict
    (or a module's), plain values only, so that any checkpoint format can store it."""
    if isinstance(state, torch.nn.Module):
        layouts = model_layouts(state) if layouts is None else layouts
        state = state.state_dict()
    layouts = layouts or {}
    return {"format": format_version,
            "tensors": {name: {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                               "layout": layouts.get(name, "plain")}
                        for name, t in state.items() if isinstance(t, torch.Tensor)}}


def compare(saved: dict, expected: dict) -> list[str]:
    """Every way ``saved`` (the checkpoint's signature) differs from ``expected``
    (this job's), one sentence each; an empty list when they agree."""
    problems = []
    if saved.get("format") != expected.get("format"):
        problems.append(f"format: the checkpoint was written in format {saved.get('format')!r}, "
                        f"this job reads format {expected.get('format')!r}")
    have, want = saved.get("tensors", {}), expected.get("tensors", {})
    for name in want:
        if name not in have:
            problems.append(f"{name}: missing from the checkpoint")
    for name in have:
        if name not in want:
            problems.append(f"{name}: in the checkpoint but not in this job (another model?)")
    for name in want:
        if name not in have:
            continue
        for field in ("shape", "dtype", "layout"):
            a, b = have[name].get(field), want[name].get(field)
            if field == "shape":
                a, b = list(a or []), list(b or [])
            if a != b:
                problems.append(f"{name}: {field} {a} in the checkpoint, this job expects {b}")
    return problems


def require_compatible(saved: dict, expected: dict, where: str = "the checkpoint") -> None:
    """Raise ``IncompatibleCheckpoint`` naming every mismatch (the first 8 and a count)."""
    problems = compare(saved, expected)
    if problems:
        shown = "\n  ".join(problems[:8])
        more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        count = f"{len(problems)} mismatch" + ("es" if len(problems) > 1 else "")
        raise IncompatibleCheckpoint(f"{where} does not fit this job ({count}):\n  {shown}{more}")


def _from_metadata(fmt, tensors: dict, stored: dict | None) -> dict:
    """A signature: names, shapes and dtypes as the files hold them, the layout tags as
    the writer declared them (``plain`` where it declared none)."""
    layouts = {k: v.get("layout", "plain") for k, v in (stored or {}).get("tensors", {}).items()}
    return {"format": fmt,
            "tensors": {k: {**v, "layout": layouts.get(k, "plain")} for k, v in tensors.items()}}


def _format(container: str, readable: bool, stored: dict | None):
    """The signature's format, or the container's own version where this code cannot
    read it (the store's manifest, DCP's ``Metadata.version``): either differs from
    this job's ``SIGNATURE_FORMAT`` and is reported as such."""
    if not readable:
        return f"{container} (this code reads another)"
    return stored.get("format") if stored else f"{container}, no signature saved"


def store_signature(path: str, prefix: str = "model") -> dict:
    """The signature of a checkpoint of ``helpers.checkpoint.store`` (a ``stepNNNNNNNN``
    directory) holding ``{prefix: state dict, "signature": signature(...)}``: format from
    its manifest, tensors from rank 0's table of the manifest (full tensors or Shards'
    global shapes), layouts from the stored signature (a mmap'ed read of one entry)."""
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    head = f"/{prefix}/"
    tensors = {k[len(head):]: {"shape": v["shape"], "dtype": v["dtype"].replace("torch.", "")}
               for k, v in manifest["files"]["rank0.pt"]["tensors"].items() if k.startswith(head)}
    tensors.update({k[len(head):]: {"shape": v["global_shape"],
                                    "dtype": v["dtype"].replace("torch.", "")}
                    for k, v in manifest["shards"].items() if k.startswith(head)})
    state = torch.load(os.path.join(path, "rank0.pt"), weights_only=True, mmap=True)
    stored = state.get("signature") if isinstance(state, dict) else None
    return _from_metadata(_format(f"store format {manifest.get('format')}",
                                  manifest.get("format") == STORE_FORMAT, stored), tensors, stored)


def dcp_signature(path: str, prefix: str = "model") -> dict:
    """The signature of a DCP checkpoint holding ``{prefix: state dict, "signature":
    json text}``: names, sizes and dtypes from its ``.metadata`` (no tensor is read),
    the layouts from the stored signature (one small entry loaded: a collective when
    a process group is up, so every rank calls it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

    meta = dcp.FileSystemReader(path).read_metadata()
    head = f"{prefix}."
    tensors = {k[len(head):]: {"shape": list(m.size),
                               "dtype": str(m.properties.dtype).replace("torch.", "")}
               for k, m in meta.state_dict_metadata.items()
               if k.startswith(head) and hasattr(m, "size")}
    stored = None
    if "signature" in meta.state_dict_metadata:
        holder = {"signature": ""}
        dcp.load(holder, checkpoint_id=path)
        stored = json.loads(holder["signature"])
    return _from_metadata(_format(f"DCP version {meta.version}",
                                  meta.version == CURRENT_DCP_VERSION, stored), tensors, stored)


def qkv_per_head(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """c_attn's rows [q; k; v] (3h, ...) regrouped head by head [q0 k0 v0 q1 k1 v1 ...],
    the order of Megatron-LM's fused QKV; same shape, other meaning."""
    three_h = weight.size(0)
    d = three_h // (3 * n_head)
    return weight.reshape(3, n_head, d, *weight.shape[1:]).transpose(0, 1).reshape(weight.shape)


def qkv_stacked(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of ``qkv_per_head``."""
    d = weight.size(0) // (3 * n_head)
    return weight.reshape(n_head, 3, d, *weight.shape[1:]).transpose(0, 1).reshape(weight.shape)
