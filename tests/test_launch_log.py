"""COURSE_LAUNCH_LOG and tools/launch_log.py: what make test-gpu reports after its nccl runs."""

import os

from helpers import launch
from tools import launch_log


def test_every_launch_is_logged_with_its_backend_and_size(tmp_path, monkeypatch):
    log = tmp_path / "launches.log"
    monkeypatch.setenv("COURSE_LAUNCH_LOG", str(log))
    launch(os.getpid, 2, nccl_rules=False)
    launch(os.getpid, 3, nccl_rules=True)
    lines = log.read_text().splitlines()
    assert lines == ["gloo 2", "gloo 3 rules"]  # (no GPU here: "auto" is gloo)
    counts = launch_log.summarize(lines + ["nccl 4", "nccl 4"])
    assert counts == {("gloo", 2): 1, ("gloo (NCCL's rules)", 3): 1, ("nccl", 4): 2}
    text = launch_log.table(counts)
    assert text.splitlines()[0].split() == ["backend", "2", "ranks", "3", "ranks", "4", "ranks"]
    assert "no launch ran on nccl" not in text
    assert "no launch ran on nccl" in launch_log.table(launch_log.summarize(lines))
