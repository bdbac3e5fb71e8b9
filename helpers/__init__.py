"""Distributed LLM Training, hands-on: the mechanisms behind the notebooks.

One mechanism per module; each opens with a docstring that explains it.
``launch`` and ``rank_info`` are imported here because every chapter uses them.
In a notebook kernel, importing the package also applies the course's plot
style (``helpers.plots``) and starts the rank server in the background
(``helpers.launch.pool.prestart``: it imports torch, seconds, while the notebook's
first cells run, so the first launch finds it ready); ranks and scripts skip both.
"""

import sys

from helpers.launch import RankError, RankInfo, RankTimeout, launch, rank_info, shutdown

if "ipykernel" in sys.modules:  # a Jupyter kernel; ranks are plain processes and never plot
    from helpers.launch import info as _info, pool as _pool

    # First: the server's seconds overlap the rest of this import (matplotlib's among them).
    if not _info.under_torchrun() and not _info.in_rank():
        _pool.prestart()

# The collective recorder plugs into the launcher (launch(..., record=True) and
# the diff a failed launch ends with); importing it here registers it.
import helpers.debug  # noqa: E402,F401

if "ipykernel" in sys.modules:
    from helpers import plots as _plots

    _plots.use()

__all__ = ["launch", "rank_info", "RankInfo", "RankError", "RankTimeout", "shutdown"]
