"""What the learner's code sent and called, inside a rank: one spy for every check.

A check that counts messages or forbids a shortcut must see every call whatever its
spelling: ``dist.isend``, ``torch.distributed.isend``, ``from torch.distributed import
isend``, a ``P2POp`` inside ``batch_isend_irecv``, ``dst=`` or ``group_dst=``. So the spy
does not replace any function of ``torch.distributed`` (a name imported earlier would
keep torch's, and ``P2POp`` would refuse a replaced ``isend``): it watches the process
group's own methods, where every one of those calls ends
(``helpers.launch.wire``, shared with NCCL's rules).

``with communication_spy(...) as spy:`` inside a rank function records

* ``spy.calls``: one ``Seen`` per operation, in posting order: ``op`` (what moved:
  "send", "recv", "all_reduce", "all_gather_into_tensor", ...), ``api`` (the function
  called: "isend", "batch_isend_irecv", "all_gather_object", ...), ``peer`` (global
  rank), ``nbytes`` (this rank's tensors handed in), ``batched``, ``ranks`` (the
  group's global ranks);
* ``spy.sends``: ``(destination global rank, bytes, a CPU copy of the tensor)`` per
  send; ``spy.recvs``: ``(source global rank, bytes)`` per receive;
* ``spy.collectives``: every collective, named as the code called it (so
  ``all_gather_object`` appears as itself, once per operation it posts);
* ``spy.bytes(*ops)``: the bytes this rank handed to those operations;

and, while active:

* a send or receive to a rank outside the group raises at once, naming it (gloo
  would wait forever for a rank that does not exist, and the check would only
  report a hang);
* the collectives named in ``refuse`` (by operation or by the function called)
  raise with the given reason;
* ``recv_dtype``: a receive buffer of another dtype raises, naming it (gloo would
  abort the process on the size mismatch with no word of the cause);
* ``device``: a sent or received tensor on another device raises, naming it.

Not seen: collectives torch issues from C++ (DDP's reducer, DTensor's functional
collectives); see ``helpers.launch.wire``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

from helpers.launch import wire


@dataclasses.dataclass(frozen=True)
class Seen:
    """One operation the spied code posted."""
    op: str
    api: str
    peer: int | None
    nbytes: int
    batched: bool
    ranks: tuple[int, ...]


@dataclasses.dataclass
class Spy:
    calls: list = dataclasses.field(default_factory=list)
    sends: list = dataclasses.field(default_factory=list)
    recvs: list = dataclasses.field(default_factory=list)
    collectives: list = dataclasses.field(default_factory=list)
    refuse: dict = dataclasses.field(default_factory=dict)
    recv_dtype: object = None
    keep_values: bool = True
    device: object = None

    @property
    def destinations(self) -> list[int]:
        return [dst for dst, _, _ in self.sends]

    def bytes(self, *ops: str) -> int:
        """Bytes this rank handed to the operations ``ops`` (all when none named)."""
        return sum(c.nbytes for c in self.calls if not ops or c.op in ops or c.api in ops)

    def ops(self) -> list[str]:
        return [c.op for c in self.calls]

    # the wire's observer
    def before(self, call: wire.Call) -> None:
        if call.op in wire.P2P:
            self._p2p(call)
        else:
            why = self.refuse.get(call.op, self.refuse.get(call.api))
            if why is not None:
                raise RuntimeError(f"dist.{call.api} is switched off in this check: {why}")
            self.collectives.append(call.api if call.api in _COLLECTIVE_APIS else call.op)
        self.calls.append(Seen(call.op, call.api, call.peer, call.nbytes, call.batched,
                               call.ranks))

    def _p2p(self, call: wire.Call) -> None:
        import torch.distributed as dist

        sending = call.op == "send"
        if call.group_peer is not None and not 0 <= call.group_peer < len(call.ranks):
            raise ValueError(
                f"rank {dist.get_rank()} {'sends to' if sending else 'receives from'} rank "
                f"{call.group_peer}, which is not in its group (ranks {list(call.ranks)}): a "
                f"rank number computed past the last rank, or hard-coded for another world "
                f"size? (gloo would wait for it forever)")
        tensor = call.tensors[0]
        if self.device is not None and tensor.device != self.device:
            raise RuntimeError(
                f"{'sending' if sending else 'receiving into'} a tensor on {tensor.device}, "
                f"but the data is on {self.device}: a buffer made without device= (as "
                f"torch.empty(k)) lands on the default device. On a GPU node that is the CPU "
                f"while the data is on the GPU: its message goes to gloo, the peer's to "
                f"nccl, and the two never meet. Allocate with torch.empty_like(chunk), or "
                f"device=x.device")
        nbytes = tensor.numel() * tensor.element_size()
        if sending:
            copy = tensor.detach().to("cpu", copy=True) if self.keep_values else None
            self.sends.append((call.peer, nbytes, copy))
        else:
            if self.recv_dtype is not None and tensor.dtype != self.recv_dtype:
                raise RuntimeError(f"receiving into a {tensor.dtype} buffer, but the messages "
                                   f"carry {self.recv_dtype}: allocate receive buffers with "
                                   f"the data's dtype (torch.empty_like(chunk))")
            self.recvs.append((call.peer, nbytes))


# The torch.distributed functions a check may name in ``refuse`` or find in
# ``collectives`` as themselves (the operations they post are named by ``op``).
_COLLECTIVE_APIS = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                    "all_gather_single", "all_gather_object", "reduce_scatter",
                    "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
                    "all_to_all_single", "reduce", "gather", "scatter", "barrier",
                    "broadcast_object_list", "gather_object", "scatter_object_list",
                    "all_reduce_coalesced", "all_gather_coalesced")


@contextlib.contextmanager
def communication_spy(refuse: dict[str, str] | None = None, recv_dtype=None,
                      keep_values: bool = True, device=None) -> Iterator[Spy]:
    """See the module docstring. ``refuse``: {operation or function name: why it is
    refused here}; ``device``: the device every sent or received tensor must be on."""
    spy = Spy(refuse=dict(refuse or {}), recv_dtype=recv_dtype, keep_values=keep_values,
              device=device)
    with wire.observing(spy):
        yield spy
