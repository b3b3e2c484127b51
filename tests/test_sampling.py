"""The sampler's distribution against transformers' logits warpers (the reference).

For fixed logits, the probability of each token after top-k, temperature, top-p and min-p is what
transformers' warpers leave, applied in that order (llama.cpp's chain). Many seeded draws from our
sampler must land only on the tokens those warpers keep, with frequencies that pass a chi-square test
against the softmax of the warped scores.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
scipy_stats = pytest.importorskip("scipy.stats")
gen = pytest.importorskip("transformers.generation.logits_process")

import dasllama as d
from dasllama import _core

N = 40000


def _reference(logits: np.ndarray, p: d.SamplingParams) -> np.ndarray:
    s = torch.tensor(logits, dtype=torch.float64)[None]
    ids = torch.zeros((1, 1), dtype=torch.long)
    if p.top_k > 0:
        s = gen.TopKLogitsWarper(p.top_k)(ids, s)
    s = gen.TemperatureLogitsWarper(p.temp)(ids, s)
    if p.top_p < 1:
        s = gen.TopPLogitsWarper(p.top_p)(ids, s)
    if p.min_p > 0:
        s = gen.MinPLogitsWarper(p.min_p)(ids, s)
    return torch.softmax(s, -1)[0].numpy()


def _logits(kind: str, V: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "peaked":  # a real LM's shape: a few likely tokens over a long tail
        return (rng.standard_normal(V) * 1.5 + np.where(rng.random(V) < 0.01, 4.0, 0.0)).astype(np.float32)
    return (rng.standard_normal(V) * 0.5).astype(np.float32)  # flat: a random model's shape


CASES = [
    d.SamplingParams(temp=1.0),
    d.SamplingParams(temp=0.7, top_p=0.9),
    d.SamplingParams(temp=1.0, min_p=0.05),
    d.SamplingParams(temp=1.2, top_p=0.8, min_p=0.02),
    d.SamplingParams(temp=0.8, top_k=40, top_p=0.95, min_p=0.05),
    d.SamplingParams(temp=1.0, top_k=300),
]


@pytest.mark.parametrize("kind", ["peaked", "flat"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_sampling_matches_transformers_warpers(kind, case):
    p = CASES[case]
    rng = np.random.default_rng(100 + case)
    V = 3000
    logits = _logits(kind, V, rng)
    ref = _reference(logits, p)
    got = np.asarray(_core.sample_logits(logits, p, seed=7 + case, n=N))
    counts = np.bincount(got, minlength=V)
    # The support: nothing outside what the warpers keep.
    assert counts[ref == 0].sum() == 0
    kept = ref > 0
    assert kept.sum() > 1
    # Frequencies: chi-square over the kept tokens, the rare ones pooled so every bin expects >= 5.
    exp, obs = ref[kept] * N, counts[kept].astype(np.float64)
    order = np.argsort(exp)
    exp, obs = exp[order], obs[order]
    small = np.cumsum(exp) < 5 * 20  # pool the smallest into one bin
    e = np.concatenate([[exp[small].sum()], exp[~small]]) if small.any() else exp
    o = np.concatenate([[obs[small].sum()], obs[~small]]) if small.any() else obs
    big = e >= 5
    e = np.concatenate([[e[~big].sum()], e[big]]) if (~big).any() else e
    o = np.concatenate([[o[~big].sum()], o[big]]) if (~big).any() else o
    assert scipy_stats.chisquare(o, e * o.sum() / e.sum()).pvalue > 1e-4


def test_greedy_and_top_k_pick_as_defined():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal(50000).astype(np.float32)
    logits[[17, 31000]] = logits.max() + 1  # a tie for the max: the lower id wins
    assert _core.sample_logits(logits, d.SamplingParams(), n=3) == [17, 17, 17]
    # top_k=1 with a temperature is greedy too; top_k=2 draws only the two tied ids.
    assert set(_core.sample_logits(logits, d.SamplingParams(temp=1.0, top_k=1), n=50)) == {17}
    assert set(_core.sample_logits(logits, d.SamplingParams(temp=1.0, top_k=2), n=200)) == {17, 31000}
    # A temperature whose inverse overflows f32 (a denormal) is greedy, not NaN weights.
    for k in (0, 40):
        assert _core.sample_logits(logits, d.SamplingParams(temp=1e-45, top_k=k, top_p=0.9), n=3) == [17, 17, 17]


def test_penalties_apply_to_the_history():
    logits = np.zeros(100, np.float32)
    logits[5], logits[9] = 3.0, 2.9
    p = d.SamplingParams(repeat_penalty=1.5)
    assert _core.sample_logits(logits, p, history=[]) == [5]
    assert _core.sample_logits(logits, p, history=[5]) == [9]  # 3.0 / 1.5 < 2.9
    with pytest.raises(ValueError):
        _core.sample_logits(np.zeros((2, 2), np.float32), p)
    with pytest.raises(ValueError):
        _core.sample_logits(logits, d.SamplingParams(top_p=0.0))
