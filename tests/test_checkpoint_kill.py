"""The planted kill of chapter 17's torchrun job says which rank it kills before it dies:
torchrun's agent logs only the first worker exit it collects, which may be the peer that
failed because of it, so the chapter reads the planted rank from this line."""

import signal
import subprocess
import sys


def test_the_killed_rank_names_itself_before_sigkill(tmp_path):
    code = ("from helpers.checkpoint.train import _killer\n"
            "assert _killer((4, 1), 4, 0) is None and _killer((4, 1), 3, 1) is None\n"
            "_killer((4, 1), 4, 1)('ignored')\n"
            "print('still alive')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert done.stdout == ("rank 1 SIGKILLs itself in the step-4 save, its file written and "
                           "the manifest not\n")
