"""Lab 19 checks: pass on the solution, fail on the lab's stub and on plausible mistakes."""

import pytest

from helpers.checks import CheckFailed, ch19
from helpers.frameworks import Plan
from helpers.frameworks.estimate import bytes_per_param
from helpers.memory import activation_bytes_model, model_state_bytes
from tools.nbtool import exercise

SOL, LAB = "solutions/19_frameworks_solution.ipynb", "labs/19_frameworks_lab.ipynb"
CASES = [("translate", ch19.check_translate), ("per_gpu_memory", ch19.check_per_gpu_memory)]


@pytest.mark.parametrize("name, check", CASES)
def test_solution_passes(name, check, capsys):
    check(exercise(SOL, name))
    assert capsys.readouterr().out.startswith("✓")


@pytest.mark.parametrize("name, check", CASES)
def test_lab_stub_fails(name, check):
    with pytest.raises(CheckFailed, match="not implemented yet"):
        check(exercise(LAB, name))


def test_dp_that_forgets_the_pipeline_fails():
    def translate(flags, world):
        tp = int(flags.get("--tensor-model-parallel-size", 1))
        pp = int(flags.get("--pipeline-model-parallel-size", 1))
        micro = int(flags.get("--micro-batch-size", 1))
        dp = world // tp                                       # wrong: pp also takes GPUs
        glob = int(flags.get("--global-batch-size", micro * dp))
        return Plan(dp=dp, tp=tp, pp=pp, micro_batch=micro, grad_accum=glob // (micro * dp),
                    zero_stage=1 if "--use-distributed-optimizer" in flags else 0,
                    sequence_parallel="--sequence-parallel" in flags,
                    recompute=flags.get("--recompute-granularity", "none"))
    with pytest.raises(CheckFailed, match="dp should be 8, got 128"):
        ch19.check_translate(translate)


def _memory(forget_optimizer=False, forget_activations=False):
    def per_gpu_memory(plan, model):
        w, g, o = bytes_per_param(plan)
        states = model_state_bytes(model.total_params() / (plan.tp * plan.pp),
                                   dp=plan.shard_ranks, zero_stage=plan.zero_stage,
                                   param_bytes=w, grad_bytes=g,
                                   optimizer_bytes=0 if forget_optimizer else o).total
        act = activation_bytes_model(model.seq, plan.micro_batch, model.hidden, model.heads,
                                     model.layers, tp=plan.tp, pp=plan.pp,
                                     sequence_parallel=plan.sequence_parallel,
                                     recompute=plan.recompute, vocab=model.vocab)
        return states + (0 if forget_activations else act)
    return per_gpu_memory


def test_reference_shape_of_the_answer_passes(capsys):
    ch19.check_per_gpu_memory(_memory())
    assert capsys.readouterr().out.startswith("✓")


def test_memory_that_forgets_the_optimizer_state_fails():
    with pytest.raises(CheckFailed, match="optimizer state is missing"):
        ch19.check_per_gpu_memory(_memory(forget_optimizer=True))


def test_memory_that_forgets_activations_fails():
    with pytest.raises(CheckFailed, match="activations are missing"):
        ch19.check_per_gpu_memory(_memory(forget_activations=True))


def test_memory_without_model_parallel_split_fails():
    def unsplit(plan, model):
        return _memory()(plan.replace(tp=1, pp=1, dp=plan.dp, sequence_parallel=False), model)
    with pytest.raises(CheckFailed, match="expected"):
        ch19.check_per_gpu_memory(unsplit)
