"""Analytic estimates: the speedup formula's limits, Σmin(p, q), the cost ratio and the α estimate."""

from __future__ import annotations

import math

import pytest
import torch

from distill.evaluate import analytic as A


def test_speedup_formula_limits():
    for alpha in (0.0, 0.3, 0.9, 1.0):
        assert A.expected_speedup(alpha, 0, 0.2) == pytest.approx(1.0)  # k = 0: plain decoding
    for k in (1, 4):
        assert A.expected_speedup(0.0, k, 0.25) == pytest.approx(1 / (1 + k * 0.25))
        # α → 1: every draft accepted, k + 1 tokens per round; the closed form is continuous there.
        assert A.expected_speedup(1.0, k, 0.1) == pytest.approx((k + 1) / (1 + k * 0.1))
        assert A.expected_speedup(1 - 1e-7, k, 0.1) == pytest.approx(
            A.expected_speedup(1.0, k, 0.1), rel=1e-5
        )
    assert A.expected_speedup(0.8, 4, 0.0) == pytest.approx((1 - 0.8**5) / 0.2)


def test_acceptance_length_is_a_geometric_sum():
    for alpha in (0.0, 0.5, 0.95):
        for k in (0, 1, 3, 6):
            assert A.expected_acceptance_length(alpha, k) == pytest.approx(
                sum(alpha**i for i in range(k + 1))
            )
    assert A.expected_acceptance_length(1.0, 5) == 6.0
    assert A.expected_per_position_acceptance(0.5, 3) == pytest.approx([0.5, 0.25, 0.125])


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        A.expected_speedup(1.2, 2, 0.1)
    with pytest.raises(ValueError):
        A.expected_speedup(0.5, -1, 0.1)
    with pytest.raises(ValueError):
        A.expected_speedup(0.5, 2, -0.1)
    with pytest.raises(ValueError):
        A.best_k(0.5, 0.1, [])
    with pytest.raises(ValueError):
        A.expected_acceptance(torch.ones(3, 4), torch.ones(3, 5))


def test_best_k_matches_brute_force():
    ks = list(range(1, 9))
    for alpha, c in ((0.8, 0.1), (0.5, 0.3), (0.95, 0.02), (0.1, 0.5)):
        k, s = A.best_k(alpha, c, ks)
        brute = max(ks, key=lambda kk: (A.expected_speedup(alpha, kk, c), -kk))
        assert k == brute and s == pytest.approx(A.expected_speedup(alpha, brute, c))
    assert A.best_k(0.1, 0.5, ks)[1] < 1  # a poor, costly draft: even the best k is a slowdown


def test_expected_acceptance_is_one_minus_tvd():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(50, 32, generator=g), -1)
    q = torch.softmax(torch.randn(50, 32, generator=g), -1)
    assert A.expected_acceptance(p, p) == pytest.approx(1.0)
    tvd = 0.5 * (p - q).abs().sum(-1).mean().item()
    assert A.expected_acceptance(p, q) == pytest.approx(1 - tvd, abs=1e-6)
    disjoint_p = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    disjoint_q = torch.tensor([[0.0, 0.0, 0.2, 0.8]])
    assert A.expected_acceptance(disjoint_p, disjoint_q) == 0.0
    assert A.expected_acceptance(torch.tensor([[0.6, 0.4]]), torch.tensor([[0.3, 0.7]])) == pytest.approx(0.7)


def test_top1_agreement():
    p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
    q = torch.tensor([[0.5, 0.4, 0.1], [0.6, 0.3, 0.1], [0.1, 0.2, 0.7]])
    assert A.top1_agreement(p, q) == pytest.approx(2 / 3)


@pytest.fixture(scope="module")
def models(tiny_target_dir, tiny_draft_dir):
    from distill.models.draft import load_causal_lm

    torch.set_num_threads(1)
    return load_causal_lm(tiny_target_dir).eval(), load_causal_lm(tiny_draft_dir).eval()


def test_cost_ratio_is_measured(models, tiny_target_dir, tiny_draft_dir):
    target, draft = models
    step = A.measure_decode_step_s(target, context_len=16, steps=4, repeats=3)
    assert 0 < step < 1.0
    c = A.measure_cost_ratio(target, draft, context_len=16, steps=4, repeats=3)
    assert 0 < c < 10 and math.isfinite(c)
    # Folders work too (loaded on the spot), and a model against itself costs about the same.
    c_self = A.measure_cost_ratio(tiny_target_dir, tiny_target_dir, context_len=16, steps=4, repeats=3)
    assert 0.2 < c_self < 5


def _prompts(tok) -> list[list[int]]:
    out = []
    for t in ("Explain the moon.", "Write code to sort a list."):
        enc = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
        out.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))
    return out


def test_estimate_acceptance(models, tiny_tokenizer):
    target, draft = models
    prompts = _prompts(tiny_tokenizer)
    same = A.estimate_acceptance(target, target, prompts, max_tokens=12, temperature=1.0)
    assert same["alpha"] == pytest.approx(1.0, abs=1e-4) and same["top1_agreement"] == 1.0
    assert same["num_positions"] == 24 and len(same["alpha_per_position"]) == 12
    poor = A.estimate_acceptance(target, draft, prompts, max_tokens=12, temperature=1.0)
    assert 0.0 < poor["alpha"] < 0.9
    # Greedy drafting: q is the one-hot of the draft argmax, so α = E[p(argmax q)].
    greedy = A.estimate_acceptance(
        target, draft, prompts, max_tokens=12, temperature=1.0, draft_sample_method="greedy"
    )
    assert 0.0 <= greedy["alpha"] < 1.0
    # At T = 0 both are one-hot: α is exactly the top-1 agreement.
    t0 = A.estimate_acceptance(target, draft, prompts, max_tokens=12, temperature=0.0)
    assert t0["alpha"] == pytest.approx(t0["top1_agreement"])


def test_estimate_matches_measured_acceptance_at_k1(models, tiny_tokenizer):
    """At T = 0 and k = 1 the engine verifies draft argmax == target argmax along the target's greedy path,
    so the estimate and the measurement must agree closely. The draft is the target with noisy weights, so
    that α lands mid-range (a random draft's α ≈ 0 would make the comparison empty)."""
    import copy

    from distill.evaluate import reference as R

    target = models[0]
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for prm in draft.parameters():
            prm.add_(torch.randn(prm.shape, generator=g) * 0.02 * prm.std())
    prompts = _prompts(tiny_tokenizer)
    est = A.estimate_acceptance(target, draft, prompts, max_tokens=40, temperature=0.0)
    accepted = proposed = 0
    for prompt in prompts:
        gen = R.speculative_generate(
            target, draft, prompt, max_tokens=40, eos_token_id=None, k=1, sampling=R.Sampling()
        )
        accepted += gen.stats.num_accepted_tokens
        proposed += gen.stats.num_draft_tokens
    assert 0.2 < est["alpha"] < 0.95
    assert abs(accepted / proposed - est["alpha"]) < 0.1


# ---- parallel (PARD) drafts -------------------------------------------------------------------------------


def test_parallel_formulas():
    # equal α at every position: the geometric sum of the ordinary formula, but one draft forward per round
    for alpha in (0.0, 0.4, 1.0):
        for k in (1, 3):
            e = A.parallel_tokens_per_round([alpha] * 4, k)
            assert e == pytest.approx(A.expected_acceptance_length(alpha, k))
            assert A.expected_parallel_speedup([alpha] * 4, k, 0.2) == pytest.approx(e / 1.2)
            assert A.expected_speedup(alpha, k, 0.2, parallel=True) == pytest.approx(e / 1.2)
    assert A.parallel_tokens_per_round([0.9, 0.5, 0.2], 3) == pytest.approx(1 + 0.9 + 0.45 + 0.09)
    assert A.parallel_tokens_per_round([0.9, 0.5], 0) == 1.0
    assert A.expected_speedup(0.5, 0, 0.3, parallel=True) == 1.0
    with pytest.raises(ValueError):
        A.parallel_tokens_per_round([0.9, 0.5], 3)  # no α for position 2
    with pytest.raises(ValueError):
        A.parallel_tokens_per_round([1.5], 1)


@pytest.fixture(scope="module")
def parallel_pair(models, tiny_tokenizer):
    """(target, the target with slightly noisy weights marked as a 3-token parallel draft)."""
    import copy

    from distill.models.draft import choose_mask_token, mark_parallel

    target = models[0]
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for prm in draft.parameters():
            prm.add_(torch.randn(prm.shape, generator=g) * 0.02 * prm.std())
    mark_parallel(draft, 3, choose_mask_token(tiny_tokenizer))
    return target, draft


@torch.inference_mode()
def test_packed_parallel_estimate_equals_vllm_layout_rounds(parallel_pair, tiny_tokenizer):
    """Each row of the packed estimate is what a round fed [context, next token, mask, mask] proposes."""
    from distill.evaluate import reference as R

    target, draft = parallel_pair
    mask = int(draft.config.pard_token)
    prompt = _prompts(tiny_tokenizer)[0]
    cont = R.target_generate(target, prompt, max_tokens=12, eos_token_id=None, sampling=R.Sampling())
    accept, match = A.parallel_proposal_acceptance(
        target, draft, prompt, cont, k=3, mask_id=mask, sampling=R.Sampling(), draft_sample_method="greedy"
    )
    assert accept.shape == match.shape == (len(cont) - 3, 3)
    assert torch.equal(accept, match.double())  # T = 0, greedy: acceptance is top-1 agreement
    for r in range(len(cont) - 3):  # round r: next token cont[r], proposals for cont[r+1 .. r+3]
        ids = torch.tensor([[*prompt, *cont[: r + 1], mask, mask]])
        proposal = draft(input_ids=ids).logits[0, -3:].argmax(-1).tolist()
        assert match[r].tolist() == [a == b for a, b in zip(proposal, cont[r + 1 : r + 4], strict=True)]


def test_estimate_parallel_acceptance(parallel_pair, models, tiny_tokenizer):
    target, draft = parallel_pair
    prompts = _prompts(tiny_tokenizer)
    est = A.estimate_parallel_acceptance(target, draft, prompts, max_tokens=16)
    assert est["parallel"] is True and est["k"] == 3 and est["num_rounds"] == 2 * (16 - 3)
    alphas, at_least = est["alpha_per_draft_position"], est["accept_at_least"]
    assert all(0.0 <= a <= 1.0 for a in alphas) and at_least == sorted(at_least, reverse=True)
    assert est["tokens_per_round"][-1] == pytest.approx(A.parallel_tokens_per_round(alphas, 3))
    assert est["alpha_per_draft_position"][0] == pytest.approx(est["top1_agreement_per_draft_position"][0])
    assert 0.0 < alphas[0] < 1.0 and 1.0 < est["tokens_per_round"][0] < 2.0
    # an ordinary draft has no mask: no parallel estimate
    with pytest.raises(ValueError, match="parallel draft"):
        A.estimate_parallel_acceptance(target, models[1], prompts, max_tokens=8)
    hot = A.estimate_parallel_acceptance(
        target, draft, prompts, max_tokens=16, temperature=1.0, draft_sample_method="probabilistic"
    )
    assert 0.0 < hot["tokens_per_round"][0] <= 2.0
