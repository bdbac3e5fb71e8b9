"""Argument checks shared by the benchmarks: bad arguments fail before any rank starts."""

from __future__ import annotations


def check_size_seq(size: str, seq: int, seq_flag: str = "--seq") -> None:
    """--size names a model size and a sequence of ``seq`` tokens fits its position table
    (for benchmarks whose flags differ from ``validate``'s)."""
    from helpers.model import MODEL_SIZES
    if size not in MODEL_SIZES:
        raise ValueError(f"--size must be one of {sorted(MODEL_SIZES)}, got {size!r}")
    block = MODEL_SIZES[size]["block_size"]
    if not 1 <= seq <= block:
        raise ValueError(f"{seq_flag} must be in [1, {block}] for size {size!r}, got {seq}")


def validate(args) -> None:
    """--size, --seq, --steps (and --world if present) of a benchmark."""
    check_size_seq(args.size, args.seq)
    if args.steps < 2:
        raise ValueError(f"--steps must be >= 2 (the first step is a warm-up), got {args.steps}")
    if getattr(args, "world", 2) < 2:
        raise ValueError(f"--world must be >= 2 to have anything to communicate, got {args.world}")


def at_least(args, name: str, low: float, why: str) -> None:
    """--name must be >= low; ``why`` says what the bound protects (part of the message)."""
    value = getattr(args, name.replace("-", "_"))
    if value < low:
        raise ValueError(f"--{name} must be >= {low} ({why}), got {value}")


SHAPES = ("auto", "cpu", "gpu")


def add_shapes_flag(ap) -> None:
    """``--shapes {auto,cpu,gpu}``: the problem sizes a benchmark times. GPU shapes are
    what a GPU is built for (an H100 needs thousands to fill it) and would take hours
    on a laptop's CPU; CPU shapes finish in seconds there and say nothing about a GPU."""
    ap.add_argument("--shapes", choices=SHAPES, default="auto",
                    help="problem sizes: cpu (seconds on a laptop), gpu (fill a GPU), "
                         "auto (gpu where torch sees CUDA, else cpu; the default)")


def shapes(args) -> str:
    """"cpu" or "gpu": what ``--shapes`` asked for, auto resolved by torch.cuda.is_available()."""
    if args.shapes not in SHAPES:
        raise ValueError(f"--shapes must be one of {SHAPES}, got {args.shapes!r}")
    if args.shapes != "auto":
        return args.shapes
    import torch
    return "gpu" if torch.cuda.is_available() else "cpu"
