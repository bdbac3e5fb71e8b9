"""One clock for every timeline: host time on a CPU, CUDA events on a GPU.

With gloo on CPU tensors a collective is done when ``work.wait()`` returns, so
``time.perf_counter()`` read around it measures it. With nccl it is not:
``work.wait()``, and a Future's completion (``then`` / ``add_done_callback``),
return once the collective is *queued* on the GPU; a host clock read there
measures the launch, a few microseconds, however long the transfer takes.

The idiom this module rests on: ``wait()`` makes the *current stream* wait on
the communication stream (PyTorch 2.13 docs, torch.distributed, "Synchronous
and asynchronous collective operations": after ``wait()`` the output is safe
to use on the current stream, the operation not necessarily complete), and a
Future runs its callbacks on streams synchronized the same way (torch 2.13,
``torch/futures/__init__.py``, ``Future.wait`` and ``Future.then``; its
``add_done_callback`` behaves as ``then``). So a CUDA event recorded on the current
stream right after ``work.wait()``, or inside a ``then`` callback, completes
when the GPU has finished the collective (and everything queued on that stream
before it). ``mark()`` records such an event; reading its time has to wait for
the event, so timelines keep marks and resolve them to seconds at the end,
without a synchronize inside the step being measured.

    clk = clock_for(device)         # HostClock on CPU, CudaClock on cuda:i
    t0 = clk.mark()
    work = dist.all_reduce(x, async_op=True); work.wait()
    t1 = clk.mark()                 # GPU: when the all-reduce finished
    elapsed(t0, t1)                 # seconds (synchronizes on t1 if needed)

Marks from different ranks stay comparable: a CUDA mark resolves to the host
time of an origin (``perf_counter`` read right after the origin event completed
behind a synchronize) plus the event's GPU time since that origin. Ranks on
one machine share ``perf_counter``, so their timelines line up as they do on
CPU, within the origin's error (the synchronize's return, microseconds).

On CPU, ``mark()`` is ``time.perf_counter()`` itself and a mark is a float.
On a GPU a mark taken while the stream is idle completes at once, so it also
resolves to the host time it was taken: host-side delays (a slow data loader,
a ``sleep``) show in GPU timelines as they do on CPU.

How production differs: ProcessGroupNCCL can time each collective itself.
With ``TORCH_NCCL_ENABLE_TIMING=1`` it records a start event for every
collective next to its end event and computes the per-collective duration on
the device (PyTorch 2.13 docs, "PYTORCH ProcessGroupNCCL Environment
Variables"; process-group hooks read it, pytorch/pytorch#108814). That times
the kernel from start to end; the marks here time what a rank sees, from the
moment it issued the call to the moment its stream could go on.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

__all__ = ["HostClock", "CudaClock", "CudaMark", "clock_for", "using", "seconds", "elapsed",
           "completed", "resolve"]


class HostClock:
    """CPU work (gloo): returning means done, so the host clock measures it."""

    device = torch.device("cpu")

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, mark: float) -> float:
        return mark

    def __repr__(self) -> str:
        return "HostClock()"


class CudaMark:
    """A CUDA event on the stream that was current when it was taken."""

    __slots__ = ("event", "clock")

    def __init__(self, event, clock: "CudaClock"):
        self.event, self.clock = event, clock

    def __repr__(self) -> str:
        return f"CudaMark(completed={self.event.query()})"


class CudaClock:
    """GPU work: marks are events on the current stream, resolved against one origin."""

    def __init__(self, device):
        self.device = torch.device(device)
        torch.cuda.synchronize(self.device)  # the origin must not wait behind queued work
        self._origin = torch.cuda.Event(enable_timing=True)
        self._origin.record(torch.cuda.current_stream(self.device))
        self._origin.synchronize()
        self._host_origin = time.perf_counter()  # host time of the origin, to microseconds

    def mark(self) -> CudaMark:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return CudaMark(event, self)

    def seconds(self, mark: CudaMark) -> float:
        mark.event.synchronize()  # elapsed_time needs both events completed
        return self._host_origin + self._origin.elapsed_time(mark.event) / 1e3  # ms -> s

    def __deepcopy__(self, memo):  # one clock per device and process: copies share it
        return self

    def __repr__(self) -> str:
        return f"CudaClock({self.device})"


_HOST = HostClock()
_CUDA: dict[int, CudaClock] = {}  # device index -> its clock (one origin per process)
_USING: list = []  # clocks installed by ``using``, innermost last


@contextlib.contextmanager
def using(clock):
    """Inside the block ``clock_for`` returns ``clock`` whatever the device: how
    a test puts a clock double under code that times itself."""
    _USING.append(clock)
    try:
        yield clock
    finally:
        _USING.pop()


def clock_for(device=None):
    """The clock for work on ``device`` (a device, its name, or a tensor); default:
    the calling rank's device (``rank_info().device``)."""
    if _USING:
        return _USING[-1]
    if isinstance(device, torch.Tensor):
        device = device.device
    if device is None:
        from helpers.launch.info import rank_info
        device = rank_info().device
    device = torch.device(device)
    if device.type != "cuda":
        return _HOST
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CUDA:
        _CUDA[index] = CudaClock(torch.device("cuda", index))
    return _CUDA[index]


def seconds(mark) -> float:
    """A mark in seconds (host ``perf_counter`` scale); a float passes through."""
    if isinstance(mark, CudaMark):
        return mark.clock.seconds(mark)
    return float(mark)


def elapsed(start, end) -> float:
    """Seconds from mark ``start`` to mark ``end``."""
    return seconds(end) - seconds(start)


def completed(mark) -> bool:
    """Has the work before ``mark`` finished? Host marks: yes (taken after it
    returned). CUDA marks: when the GPU has passed the event; never blocks."""
    return mark.event.query() if isinstance(mark, CudaMark) else True


def resolve(obj: Any) -> Any:
    """``obj`` with every mark inside dicts, lists and tuples turned into seconds."""
    if isinstance(obj, CudaMark):
        return seconds(obj)
    if isinstance(obj, dict):
        return {k: resolve(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [resolve(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(resolve(v) for v in obj)
    return obj
