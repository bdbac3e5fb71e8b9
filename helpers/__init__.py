"""Distributed LLM Training, hands-on: the mechanisms behind the notebooks.

One mechanism per module; each opens with a docstring that explains it.
``launch`` and ``rank_info`` are imported here because every chapter uses them.
"""

from helpers.launch import RankError, RankInfo, RankTimeout, launch, rank_info, shutdown

__all__ = ["launch", "rank_info", "RankInfo", "RankError", "RankTimeout", "shutdown"]
