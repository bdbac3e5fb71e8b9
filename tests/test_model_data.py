"""helpers.model and helpers.data: sizes, determinism, the known optimum, resumable sharding."""

import math

import pytest
import torch

from helpers.data import MarkovSource, ShardedSampler, make_dataset
from helpers.model import MODEL_SIZES, GPTConfig, build_model, count_parameters
from helpers.tolerance import assert_within_fp32_noise


@pytest.mark.parametrize("name", ["toy", "tiny", "small"])
def test_param_count_formula_matches_the_module(name):
    cfg = GPTConfig.from_name(name)
    assert count_parameters(build_model(cfg)) == cfg.n_params()


def test_gpt2_size_is_gpt2_small():
    # GPT-2 small: 124M parameters with the vocabulary padded to 50304 (Radford et al. 2019)
    assert round(GPTConfig.from_name("gpt2").n_params() / 1e6) == 124


def test_tied_embeddings_are_one_tensor():
    m = build_model("toy")
    assert m.lm_head.weight is m.wte.weight


def test_init_depends_only_on_seed():
    torch.manual_seed(123)
    a = build_model("toy", seed=7)
    torch.manual_seed(999)
    b = build_model("toy", seed=7)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    c = build_model("toy", seed=8)
    assert not torch.equal(a.wte.weight, c.wte.weight)


def test_sdpa_and_manual_attention_agree():
    m = build_model("toy")
    f = build_model("toy", attention="sdpa")
    x = torch.randint(0, 64, (3, 16))
    # two float32 attention kernels (other blocking, other softmax): each as
    # close to the float64 forward as float32 rounding allows
    exact = build_model("toy").double()(x)[0]
    assert_within_fp32_noise(f(x)[0], m(x)[0], exact, "sdpa logits")


def test_stages_compose_to_the_whole_forward():
    m = build_model("toy", n_layer=3)
    x = torch.randint(0, 64, (2, 8))
    h = m.embed(x)
    for blk in m.blocks:
        h = blk(h)
    assert torch.equal(m.head(h), m(x)[0])


@pytest.mark.parametrize("bad, match", [
    (dict(n_embd=30, n_head=4), "not divisible by n_head"),
    (dict(n_layer=0), "n_layer"),
    (dict(dropout=1.0), "dropout"),
    (dict(attention="flash"), "attention"),
])
def test_config_rejects_bad_values(bad, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**bad)
    with pytest.raises(ValueError, match="unknown model size"):
        GPTConfig.from_name("huge")
    assert set(MODEL_SIZES) >= {"toy", "tiny", "gpt2"}


def test_entropy_rate_is_exact_and_sampling_matches_it():
    src = MarkovSource(vocab_size=16, seed=3)
    pi, P = src.stationary, src.transition
    torch.testing.assert_close(pi @ P, pi)  # stationary
    H = src.entropy_rate()
    assert 0 < H < math.log(16)
    # empirical negative log-likelihood under the true chain approaches H
    seqs = src.sample(2000, 65, seed=0)
    nll = -P.log()[seqs[:, :-1], seqs[:, 1:]].mean().item()
    assert abs(nll - H) < 0.03


def test_toy_gpt_learns_towards_the_entropy_rate():
    data = make_dataset(num_sequences=1024)
    H = data.source.entropy_rate()
    model = build_model("toy")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = ShardedSampler(len(data), 32)
    first = None
    for _ in range(120):
        _, loss = model(*data.batch(next(sampler)))
        opt.zero_grad(); loss.backward(); opt.step()
        first = first or loss.item()
    assert first > math.log(64) - 0.3 and loss.item() < H + 0.35


def test_sharded_batches_concatenate_to_the_global_batch():
    full = ShardedSampler(100, 8, rank=0, world_size=1, seed=1)
    ranks = [ShardedSampler(100, 4, rank=r, world_size=2, seed=1) for r in range(2)]
    for _ in range(30):  # crosses epoch boundaries (12 steps per epoch)
        assert torch.equal(next(full), torch.cat([next(s) for s in ranks]))


def test_sampler_resumes_at_the_exact_position():
    a = ShardedSampler(50, 5, seed=2)
    for _ in range(13):
        next(a)
    b = ShardedSampler(50, 5, seed=2)
    b.load_state_dict(a.state_dict())
    assert all(torch.equal(next(a), next(b)) for _ in range(20))


def test_sampler_rejects_impossible_shapes():
    with pytest.raises(ValueError, match="outside world_size"):
        ShardedSampler(10, 2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="larger than the dataset"):
        ShardedSampler(10, 6, rank=0, world_size=2)
