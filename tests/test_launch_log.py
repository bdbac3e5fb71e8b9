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
    test = "tests/test_launch_log.py::test_every_launch_is_logged_with_its_backend_and_size"
    # (no GPU here: "auto" is gloo)
    assert lines == [f"gloo 2 asked=auto test={test}", f"gloo 3 rules asked=auto test={test}"]
    counts = launch_log.summarize(lines + ["nccl 4", "nccl 4"])
    assert counts == {("gloo", 2): 1, ("gloo (NCCL's rules)", 3): 1, ("nccl", 4): 2}
    text = launch_log.table(counts)
    assert text.splitlines()[0].split() == ["backend", "2", "ranks", "3", "ranks", "4", "ranks"]
    assert "no launch ran on nccl" not in text
    assert "no launch ran on nccl" in launch_log.table(launch_log.summarize(lines))


def test_a_cpu_run_replayed_for_a_node_of_n_gpus():
    """The dry run of make test-gpu's step 3: which logged launches would meet nccl on a
    node of 1, 2, 3, 4 or 8 GPUs (one GPU per rank, backend "auto"; "gloo" stays gloo)."""
    from helpers.launch.arguments import backend_for

    lines = ["gloo 2 rules asked=auto test=a", "gloo 3 rules asked=auto test=a",
             "gloo 4 asked=auto test=b", "gloo 8 asked=auto test=c",
             "gloo 3 rules asked=gloo test=d", "gloo 2"]
    want = {1: {}, 2: {"a": [2], "(no test)": [2]},
            3: {"a": [2, 3], "(no test)": [2]},
            4: {"a": [2, 3], "b": [4], "(no test)": [2]},
            8: {"a": [2, 3], "b": [4], "c": [8], "(no test)": [2]}}
    for gpus, nccl in want.items():
        assert launch_log.replay(lines, gpus) == nccl
        assert backend_for("gloo", 2, gpus) == "gloo"
        assert backend_for("auto", 2, gpus, nccl=False) == "gloo"
    text = launch_log.replay_table(lines, [3])
    assert text.splitlines()[0] == "== 3 GPU(s): 3 launch(es) on nccl in 2 test(s)"


def test_make_test_gpu_step_3_leaves_out_the_rows_right_on_gloo_only():
    """Step 3 runs the lab checks with the GPUs visible, where a launch is real nccl: a
    row right on gloo only (``Right(..., rules=False)``: a lone ring) is marked gloo_only
    by the harness, and step 3 deselects that mark."""
    import importlib
    import pathlib

    recipe = pathlib.Path("Makefile").read_text()
    step3 = recipe[recipe.index("== 3/3"):].split("tools/launch_log.py")[0]
    assert '-m "not gloo_only"' in step3 and '-k "ipynb or test_passes"' in step3
    found = 0
    for path in sorted(pathlib.Path("tests").glob("test_checks_ch*.py")):
        module = importlib.import_module(path.stem)
        for table in [v for v in vars(module).values()
                      if isinstance(v, type) and hasattr(v, "_passing") and "checks" in vars(v)]:
            for param in table()._passing():
                gloo_only = any(m.name == "gloo_only" for m in param.marks)
                assert gloo_only == (param.values[0].rules is False), param.id
                found += gloo_only
    assert found >= 2   # chapter 03's and chapter 10's lone rings
