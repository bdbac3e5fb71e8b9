"""Read a framework's configuration into a ``Plan``: DeepSpeed, Megatron-LM, torchtitan.

Each reader maps the knobs it knows onto ``Plan`` fields (``KNOBS`` says
which field and which chapter teaches the mechanism behind it), lists every
other knob in ``Plan.unmapped`` with the reason it is not modelled, and ends
with ``Plan.validate(world_size)``, so a configuration that its framework
would refuse at start-up (degrees that do not multiply to the GPUs, a batch
identity that does not hold) is refused here too, with the rule named.

* ``from_deepspeed(config, world_size, tp=1, pp=1)``: a DeepSpeed JSON
  config (dict, JSON text or path). DeepSpeed itself has no TP/PP degrees in
  its config (Megatron-DeepSpeed passes them in code), so dp = world / (tp pp).
  Like DeepSpeed, any two of train_batch_size, train_micro_batch_size_per_gpu
  and gradient_accumulation_steps determine the third.
* ``from_megatron(args, world_size)``: Megatron-LM's command line (a string,
  as in its example scripts, or a list). dp = world / (tp pp cp), as
  Megatron computes it; accumulation = global / (micro dp).
* ``from_torchtitan(toml, world_size)``: a torchtitan job TOML (text or
  path). dp = replicate x shard; a shard degree of -1 takes the rest.
  FSDP2 shards weights, gradients and optimizer state (stage 3) over the
  shard degree; torchtitan's TP always shards the norms' activations along
  the sequence, i.e. Megatron's sequence parallelism.

How production differs: the frameworks check far more (kernels available,
dtypes of every buffer), and they change their flags between versions; the
names here are those of Megatron-Core 0.x / DeepSpeed 0.1x / torchtitan 2025.
"""

from __future__ import annotations

import json
import os
import shlex
import tomllib

from helpers.frameworks.plan import ModelSpec, Plan

__all__ = ["from_deepspeed", "from_megatron", "from_torchtitan", "megatron_model", "KNOBS",
           "CHAPTERS", "knob_table"]

# chapter number -> course notebook, for links from a knob to its mechanism
CHAPTERS = {
    "05": "05_batch_size_lr_scaling", "04": "04_ddp_buckets", "08": "08_tensor_parallel_basics",
    "09": "09_tp_in_transformer", "10": "10_sequence_parallel", "11": "11_pipeline_basics",
    "12": "12_pipeline_schedules", "13": "13_recompute_and_precision", "14": "14_zero_stages",
    "15": "15_fsdp", "16": "16_comm_overlap", "17": "17_checkpoint_resume",
    "21": "21_expert_parallelism", "06": "06_where_memory_goes",
}

# (framework, knob) -> (Plan field it sets, chapter that teaches the mechanism)
KNOBS: dict[tuple[str, str], tuple[str, str]] = {
    ("megatron", "--tensor-model-parallel-size"): ("tp", "08"),
    ("megatron", "--pipeline-model-parallel-size"): ("pp", "11"),
    ("megatron", "--num-layers-per-virtual-pipeline-stage"): ("vpp", "12"),
    ("megatron", "--virtual-pipeline-model-parallel-size"): ("vpp", "12"),
    ("megatron", "--context-parallel-size"): ("cp", "10"),
    ("megatron", "--expert-model-parallel-size"): ("ep", "21"),
    ("megatron", "--sequence-parallel"): ("sequence_parallel", "10"),
    ("megatron", "--use-distributed-optimizer"): ("zero_stage", "14"),
    ("megatron", "--recompute-granularity"): ("recompute", "13"),
    ("megatron", "--recompute-activations"): ("recompute", "13"),
    ("megatron", "--micro-batch-size"): ("micro_batch", "05"),
    ("megatron", "--global-batch-size"): ("global_batch", "05"),
    ("megatron", "--overlap-grad-reduce"): ("overlap_grad_reduce", "16"),
    ("megatron", "--overlap-param-gather"): ("overlap_param_gather", "16"),
    ("megatron", "--bf16"): ("precision", "13"),
    ("megatron", "--fp16"): ("precision", "13"),
    ("megatron", "--fp8-format"): ("precision", "13"),
    ("megatron", "--loss-scale"): ("loss_scaling", "13"),
    ("megatron", "--accumulate-allreduce-grads-in-fp32"): ("main_grads_fp32", "13"),
    ("megatron", "--ckpt-format"): ("checkpoint_format", "17"),
    ("deepspeed", "train_batch_size"): ("global_batch", "05"),
    ("deepspeed", "train_micro_batch_size_per_gpu"): ("micro_batch", "05"),
    ("deepspeed", "gradient_accumulation_steps"): ("grad_accum", "05"),
    ("deepspeed", "zero_optimization.stage"): ("zero_stage", "14"),
    ("deepspeed", "zero_optimization.offload_optimizer"): ("offload", "14"),
    ("deepspeed", "zero_optimization.offload_param"): ("offload", "15"),
    ("deepspeed", "zero_optimization.overlap_comm"): ("overlap_grad_reduce", "16"),
    ("deepspeed", "zero_optimization.stage3_prefetch_bucket_size"):
        ("overlap_param_gather", "16"),
    ("deepspeed", "bf16.enabled"): ("precision", "13"),
    ("deepspeed", "fp16.enabled"): ("precision", "13"),
    ("deepspeed", "fp16.loss_scale"): ("loss_scaling", "13"),
    ("deepspeed", "activation_checkpointing"): ("recompute", "13"),
    ("torchtitan", "parallelism.data_parallel_replicate_degree"): ("dp", "02"),
    ("torchtitan", "parallelism.data_parallel_shard_degree"): ("dp_shard", "15"),
    ("torchtitan", "parallelism.tensor_parallel_degree"): ("tp", "09"),
    ("torchtitan", "parallelism.pipeline_parallel_degree"): ("pp", "11"),
    ("torchtitan", "parallelism.pipeline_parallel_schedule"): ("vpp", "12"),
    ("torchtitan", "parallelism.pipeline_parallel_microbatch_size"): ("micro_batch", "12"),
    ("torchtitan", "parallelism.context_parallel_degree"): ("cp", "10"),
    ("torchtitan", "parallelism.expert_parallel_degree"): ("ep", "21"),
    ("torchtitan", "parallelism.fsdp_reshard_after_forward"): ("zero_stage", "15"),
    ("torchtitan", "training.local_batch_size"): ("micro_batch", "05"),
    ("torchtitan", "training.global_batch_size"): ("global_batch", "05"),
    ("torchtitan", "training.mixed_precision_param"): ("precision", "13"),
    ("torchtitan", "training.mixed_precision_reduce"): ("main_grads_fp32", "13"),
    ("torchtitan", "activation_checkpoint.mode"): ("recompute", "13"),
    ("torchtitan", "float8"): ("precision", "13"),
    ("torchtitan", "checkpoint.enable_checkpoint"): ("checkpoint_format", "17"),
}
CHAPTERS["02"] = "02_sync_sgd_data_parallel"


def knob_table(framework: str | None = None) -> list[tuple[str, str, str, str]]:
    """Rows (framework, knob, Plan field, chapter notebook) of ``KNOBS``."""
    return [(fw, knob, field, CHAPTERS[ch]) for (fw, knob), (field, ch) in KNOBS.items()
            if framework in (None, fw)]


def _why(knob: str) -> str:
    """Why a knob is not part of the plan (it is listed, never dropped)."""
    k = knob.lower().lstrip("-")
    for words, reason in (
            (("lr", "adam", "weight", "decay", "clip", "init", "warmup", "beta", "eps",
              "scheduler", "iters", "steps", "seed", "max_norm", "optimizer", "rampup"),
             "training hyperparameter: changes the learning, not memory or traffic"),
            (("data", "vocab-file", "merge", "split", "tokenizer", "dataset", "path", "folder",
              "save", "load", "log", "tensorboard", "wandb", "print", "profil", "metric",
              "eval", "valid", "dump", "description", "interval", "breakdown"),
             "input / output / logging: outside the parallel plan"),
            (("bucket", "contiguous", "persistence", "live_param", "reuse", "sub_group"),
             "buffer sizing (chapter 04's buckets): changes peaks and launch counts, "
             "not modelled here"),
            (("attention-backend", "compile", "fusion", "fused", "kernel", "flash"),
             "kernel choice: speed, not the plan"),
            (("recompute-method", "recompute-num-layers", "selective_ac_option"),
             "recompute on a subset of layers: the estimate recomputes every layer"),
            (("async", "tp-comm-overlap"), "overlap of TP / checkpoint I/O: not modelled"),
    ):
        if any(w in k for w in words):
            return reason
    return "not modelled by this course"


# ---------------------------------------------------------------------------
# Megatron-LM
# ---------------------------------------------------------------------------

_MEGATRON_MODEL = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
                   "--ffn-hidden-size", "--num-query-groups", "--group-query-attention",
                   "--swiglu", "--untie-embeddings-and-output-weights", "--num-experts",
                   "--moe-router-topk", "--max-position-embeddings", "--vocab-size")


def _megatron_args(args: str | list[str]) -> dict[str, str | bool]:
    """``--flag value`` / ``--flag`` pairs; a script's ``\\`` line ends and ``#`` comments ok."""
    if isinstance(args, str):
        args = shlex.split(args.replace("\\\n", " "), comments=True)
    out: dict[str, str | bool] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--"):
            raise ValueError(f"expected a --flag, got {a!r} (after {args[i - 1]!r})"
                             if i else f"expected a --flag, got {a!r}")
        values = []
        while i + 1 < len(args) and not args[i + 1].startswith("--"):
            values.append(args[i + 1])
            i += 1
        out[a] = " ".join(values) if values else True
        i += 1
    return out


def _int(knob: str, value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{knob} needs an integer, got {value!r}") from None


def megatron_model(args: str | list[str], vocab: int) -> ModelSpec:
    """The ``ModelSpec`` a Megatron command line describes (vocab comes from the tokenizer)."""
    a = _megatron_args(args)
    missing = [k for k in ("--num-layers", "--hidden-size", "--num-attention-heads",
                           "--seq-length") if k not in a]
    if missing:
        raise ValueError(f"the model needs {', '.join(missing)}")
    get = lambda k, d=None: _int(k, a[k]) if k in a else d  # noqa: E731
    return ModelSpec(layers=get("--num-layers"), hidden=get("--hidden-size"),
                     heads=get("--num-attention-heads"), vocab=vocab, seq=get("--seq-length"),
                     ffn=get("--ffn-hidden-size"),
                     kv_heads=get("--num-query-groups") if "--group-query-attention" in a
                     else None,
                     gated_mlp="--swiglu" in a,
                     tied_embeddings="--untie-embeddings-and-output-weights" not in a,
                     experts=get("--num-experts", 0), top_k=get("--moe-router-topk", 1))


def from_megatron(args: str | list[str], world_size: int) -> Plan:
    """A ``Plan`` from Megatron-LM command-line arguments (validated, unmapped knobs kept)."""
    a = _megatron_args(args)
    get = lambda k, d: _int(k, a[k]) if k in a else d  # noqa: E731
    tp, pp = get("--tensor-model-parallel-size", 1), get("--pipeline-model-parallel-size", 1)
    cp, ep = get("--context-parallel-size", 1), get("--expert-model-parallel-size", 1)
    if world_size % (tp * pp * cp):
        raise ValueError(f"degrees must multiply to the world size: tp {tp} x pp {pp} x "
                         f"cp {cp} = {tp * pp * cp} does not divide {world_size} GPUs")
    dp = world_size // (tp * pp * cp)
    vpp = get("--virtual-pipeline-model-parallel-size", 1)
    if "--num-layers-per-virtual-pipeline-stage" in a:
        per = get("--num-layers-per-virtual-pipeline-stage", 1)
        layers = get("--num-layers", None)
        if layers is None:
            raise ValueError("--num-layers-per-virtual-pipeline-stage needs --num-layers")
        if layers % (pp * per):
            raise ValueError(f"{layers} layers do not split into pp {pp} stages of chunks of "
                             f"{per} layers")
        vpp = layers // (pp * per)
    micro = get("--micro-batch-size", 1)
    global_batch = get("--global-batch-size", micro * dp)
    if global_batch % (micro * dp):
        raise ValueError(f"global batch = micro-batch x accumulation x dp: {global_batch} is "
                         f"not a multiple of micro-batch {micro} x dp {dp} = {micro * dp}")
    precision, scaling = "fp32", None
    if "--bf16" in a and "--fp16" in a:
        raise ValueError("--bf16 and --fp16 exclude each other")
    if "--bf16" in a:
        precision = "bf16"
    if "--fp16" in a:
        precision, scaling = "fp16", "static" if "--loss-scale" in a else "dynamic"
    if "--fp8-format" in a:
        if precision not in ("bf16", "fp16"):
            raise ValueError("--fp8-format runs FP8 GEMMs inside a --bf16 (or --fp16) model")
        precision, scaling = "fp8", None
    recompute = "selective" if "--recompute-activations" in a else "none"
    if "--recompute-granularity" in a:
        recompute = a["--recompute-granularity"]
        if recompute not in ("full", "selective"):
            raise ValueError(f"--recompute-granularity is full or selective, got {recompute!r}")
    known = {k for (fw, k) in KNOBS if fw == "megatron"} | set(_MEGATRON_MODEL)
    unmapped = tuple((k, v, _why(k)) for k, v in a.items() if k not in known)
    sequence_parallel = "--sequence-parallel" in a
    if sequence_parallel and tp == 1:   # Megatron turns it off (arguments.py), so do we
        sequence_parallel = False
        unmapped += (("--sequence-parallel", True, "ignored with tp = 1, as Megatron does"),)
    plan = Plan(dp=dp, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep,
                zero_stage=1 if "--use-distributed-optimizer" in a else 0,
                # Megatron accumulates and reduces bf16 models' gradients in fp32 by default
                main_grads_fp32=precision in ("bf16", "fp8") or
                "--accumulate-allreduce-grads-in-fp32" in a,
                # with 16-bit gradients the fp16 optimizer copies them to fp32 main grads
                optimizer_grads_fp32=precision == "fp16" and
                "--accumulate-allreduce-grads-in-fp32" not in a,
                precision=precision, loss_scaling=scaling, recompute=recompute,
                sequence_parallel=sequence_parallel, micro_batch=micro,
                grad_accum=global_batch // (micro * dp), global_batch=global_batch,
                overlap_grad_reduce="--overlap-grad-reduce" in a,
                overlap_param_gather="--overlap-param-gather" in a,
                checkpoint_format=str(a.get("--ckpt-format", "torch_dist")),
                source="Megatron-LM", unmapped=unmapped)
    model = None
    if all(k in a for k in ("--num-layers", "--hidden-size", "--num-attention-heads",
                            "--seq-length")):
        model = megatron_model(args, vocab=1)  # vocab plays no part in the divisibility rules
    return plan.validate(world_size, model)


# ---------------------------------------------------------------------------
# DeepSpeed
# ---------------------------------------------------------------------------

def _load(config, loader, what: str):
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)) and os.path.exists(config):
        with open(config, "rb") as f:
            return loader(f.read().decode())
    if isinstance(config, str):
        return loader(config)
    raise TypeError(f"expected a {what} dict, text or path, got {type(config).__name__}")


def _flatten(d: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def from_deepspeed(config: dict | str, world_size: int, *, tp: int = 1, pp: int = 1) -> Plan:
    """A ``Plan`` from a DeepSpeed config (dict, JSON text or path); ``tp``/``pp`` as
    passed to DeepSpeed in code (Megatron-DeepSpeed), default pure data parallelism."""
    cfg = _load(config, json.loads, "DeepSpeed JSON")
    flat = _flatten(cfg)
    autos = [k for k, v in flat.items() if v == "auto"]
    if autos:
        raise ValueError(f"{', '.join(autos)} = 'auto' is filled in by the Hugging Face "
                         f"Trainer from its own arguments; give numbers to estimate")
    if world_size % (tp * pp):
        raise ValueError(f"degrees must multiply to the world size: tp {tp} x pp {pp} does "
                         f"not divide {world_size} GPUs")
    dp = world_size // (tp * pp)
    batch = cfg.get("train_batch_size")
    micro = cfg.get("train_micro_batch_size_per_gpu")
    accum = cfg.get("gradient_accumulation_steps")
    # DeepSpeed's rule (runtime/config.py, _configure_train_batch_size): any two determine
    # the third, all three must satisfy batch = micro x accum x dp
    if batch is None and micro is None:
        raise ValueError("set train_batch_size or train_micro_batch_size_per_gpu")
    if micro is None:
        accum = accum or 1
        if batch % (accum * dp):
            raise ValueError(f"train_batch_size = micro-batch x accumulation x dp: {batch} is "
                             f"not a multiple of {accum} x {dp}")
        micro = batch // (accum * dp)
    if accum is None:
        accum = batch // (micro * dp) if batch is not None else 1
    if batch is None:
        batch = micro * accum * dp
    if batch != micro * accum * dp:
        raise ValueError(f"train_batch_size = train_micro_batch_size_per_gpu x "
                         f"gradient_accumulation_steps x dp: {micro} x {accum} x {dp} = "
                         f"{micro * accum * dp}, not {batch}")
    zero = cfg.get("zero_optimization", {}) or {}
    stage = zero.get("stage", 0)
    if stage >= 2 and pp > 1:
        # DeepSpeed's PipelineEngine asserts this: a stage accumulates gradients over all
        # its micro-batches, which sharded gradients would reduce-scatter every time
        raise ValueError(f"DeepSpeed's pipeline engine takes ZeRO stage 0 or 1 only: stage "
                         f"{stage} shards gradients, which a pipeline accumulates across "
                         f"micro-batches")
    offload = "none"
    if (zero.get("offload_optimizer") or {}).get("device", "none") not in ("none", None):
        offload = "optimizer"
    if (zero.get("offload_param") or {}).get("device", "none") not in ("none", None):
        offload = "optimizer+params" if offload == "optimizer" else "params-only"
        if offload == "params-only":
            raise ValueError("offload_param without offload_optimizer is not modelled: offload "
                             "the optimizer state too (it is the larger part)")
    bf16 = (cfg.get("bf16") or cfg.get("bfloat16") or {}).get("enabled", False)  # both spellings
    fp16 = (cfg.get("fp16") or {}).get("enabled", False)
    if bf16 and fp16:
        raise ValueError("bf16.enabled and fp16.enabled exclude each other")
    precision, scaling = ("bf16", None) if bf16 else ("fp32", None)
    if fp16:
        precision = "fp16"
        scaling = "dynamic" if (cfg["fp16"].get("loss_scale", 0) or 0) == 0 else "static"
    recompute = "full" if "activation_checkpointing" in cfg else "none"
    known_prefixes = ("train_batch_size", "train_micro_batch_size_per_gpu",
                      "gradient_accumulation_steps", "zero_optimization.stage",
                      "zero_optimization.offload_optimizer", "zero_optimization.offload_param",
                      "zero_optimization.overlap_comm",
                      "zero_optimization.stage3_prefetch_bucket_size", "bf16", "bfloat16",
                      "fp16")
    unmapped = []
    for k, v in flat.items():
        if k.startswith(known_prefixes):
            continue
        if k.startswith("activation_checkpointing"):
            why = ("DeepSpeed's activation-checkpointing options: the model must call "
                   "deepspeed.checkpointing.checkpoint; read as full recompute of every layer")
        elif k.startswith("optimizer.type"):
            why = ("Adam state (8 bytes/param) assumed" if str(v).lower().startswith("adam")
                   else f"{v}: optimizer state bytes differ from Adam's; not modelled")
        else:
            why = _why(k)
        unmapped.append((k, v, why))
    plan = Plan(dp=dp, tp=tp, pp=pp, zero_stage=stage, offload=offload,
                # ZeRO steps on fp32 partitions whose .grad is an fp32 copy of the shard
                optimizer_grads_fp32=stage >= 1 and precision != "fp32",
                precision=precision, loss_scaling=scaling, recompute=recompute,
                micro_batch=micro, grad_accum=accum, global_batch=batch,
                overlap_grad_reduce=bool(zero.get("overlap_comm", False)),
                overlap_param_gather=stage == 3 and zero.get("stage3_prefetch_bucket_size",
                                                             1) != 0,
                checkpoint_format="deepspeed (per-rank ZeRO shards)",
                source="DeepSpeed", unmapped=tuple(unmapped))
    return plan.validate(world_size)


# ---------------------------------------------------------------------------
# torchtitan
# ---------------------------------------------------------------------------

_INTERLEAVED = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "LoopedBFS")


def from_torchtitan(toml_text_or_path: str, world_size: int) -> Plan:
    """A ``Plan`` from a torchtitan job config (TOML text or path)."""
    cfg = _load(toml_text_or_path, tomllib.loads, "torchtitan TOML")
    par = cfg.get("parallelism", {})
    train = cfg.get("training", {})
    get = lambda k, d: _int(f"parallelism.{k}", par.get(k, d))  # noqa: E731
    rep, shard = get("data_parallel_replicate_degree", 1), get("data_parallel_shard_degree", -1)
    tp, pp = get("tensor_parallel_degree", 1), get("pipeline_parallel_degree", 1)
    cp, ep = get("context_parallel_degree", 1), get("expert_parallel_degree", 1)
    if shard == -1:   # torchtitan: -1 takes whatever the other degrees leave
        rest = rep * tp * pp * cp
        if world_size % rest:
            raise ValueError(f"degrees must multiply to the world size: replicate {rep} x "
                             f"tp {tp} x pp {pp} x cp {cp} = {rest} does not divide "
                             f"{world_size} GPUs")
        shard = world_size // rest
    dp = rep * shard
    local = _int("training.local_batch_size",
                 train.get("local_batch_size", train.get("batch_size", 8)))
    global_batch = _int("training.global_batch_size", train.get("global_batch_size", -1))
    if global_batch == -1:
        global_batch = local * dp
    if global_batch % (local * dp):
        raise ValueError(f"global batch = local batch x accumulation x dp: {global_batch} is "
                         f"not a multiple of {local} x {dp}")
    micro = get("pipeline_parallel_microbatch_size", 1) if pp > 1 else local
    if local % micro:
        raise ValueError(f"the pipeline cuts each local batch of {local} into micro-batches "
                         f"of {micro}: not divisible")
    accum = global_batch // (micro * dp)
    schedule = par.get("pipeline_parallel_schedule", "1F1B")
    # torchtitan gives multi-stage schedules 2 stages per rank unless the split is set
    # (pipeline_parallel_layers_per_stage, kept in unmapped)
    vpp = 2 if pp > 1 and schedule in _INTERLEAVED else 1
    reshard = par.get("fsdp_reshard_after_forward", "default")
    # "default": torchtitan reshards after forward unless a pipeline is on (its stages run
    # several micro-batches' forwards before their backwards: re-gathering would repeat)
    keep = reshard == "never" or (reshard == "default" and pp > 1)
    zero = 0 if shard == 1 else (2 if keep else 3)
    precision = {"bfloat16": "bf16", "float32": "fp32"}.get(
        train.get("mixed_precision_param", "bfloat16"))
    if precision is None:
        raise ValueError(f"training.mixed_precision_param is bfloat16 or float32, got "
                         f"{train.get('mixed_precision_param')!r}")
    converters = cfg.get("model", {}).get("converters", [])
    if "float8" in converters:
        precision = "fp8"
    mode = cfg.get("activation_checkpoint", {}).get("mode", "selective")
    if mode not in ("none", "selective", "full"):
        raise ValueError(f"activation_checkpoint.mode is none, selective or full, got {mode!r}")
    ckpt = cfg.get("checkpoint", {})
    known = {k for (fw, k) in KNOBS if fw == "torchtitan"} | {
        "training.seq_len", "training.batch_size", "model.converters",
        "activation_checkpoint.mode"}
    unmapped = []
    for k, v in _flatten(cfg).items():
        if k in known or k.startswith("float8"):
            continue
        if k.startswith("model."):
            why = "model shape: torchtitan reads it from the flavor; pass a ModelSpec"
        elif k == "checkpoint.async_mode":
            why = "asynchronous save (chapter 17): cost not modelled here"
        else:
            why = _why(k)
        unmapped.append((k, v, why))
    plan = Plan(dp=dp, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, zero_stage=zero,
                dp_shard=shard if rep > 1 else None,
                main_grads_fp32=train.get("mixed_precision_reduce", "float32") == "float32",
                params_fp32=zero > 0,   # FSDP2 keeps fp32 shards, casts per all-gather
                precision=precision, recompute=mode, sequence_parallel=tp > 1,
                micro_batch=micro, grad_accum=accum, global_batch=global_batch,
                # FSDP2 prefetches the next unit's all-gather and overlaps its reduce-scatter
                overlap_grad_reduce=zero > 0, overlap_param_gather=zero > 0,
                # torch's pipelining skips an FSDP stage's gradient sync on every
                # micro-batch but the last (torch 2.13 pipelining/stage.py
                # backward_maybe_with_nosync): the gradients are held whole
                whole_grads=zero == 2 and pp > 1,
                checkpoint_format="dcp (torch.distributed.checkpoint)"
                if ckpt.get("enable_checkpoint", ckpt.get("enable", False)) else "none",
                source="torchtitan", unmapped=tuple(unmapped))
    return plan.validate(world_size)
