"""Distributed LLM Training, hands-on: the mechanisms behind the notebooks.

One mechanism per module; each opens with a docstring that explains it.
``launch`` and ``rank_info`` are imported here because every chapter uses them.
In a notebook kernel, importing the package also applies the course's plot
style (``helpers.plots``); ranks and scripts skip it.
"""

import sys

from helpers.launch import RankError, RankInfo, RankTimeout, launch, rank_info, shutdown

if "ipykernel" in sys.modules:  # a Jupyter kernel; ranks are plain processes and never plot
    from helpers import plots as _plots

    _plots.use()

__all__ = ["launch", "rank_info", "RankInfo", "RankError", "RankTimeout", "shutdown"]
