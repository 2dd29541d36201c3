"""The reference speculative decoding engine: exact in distribution, exact in greedy, vLLM-like counters.

The statistical tests sample thousands of independent speculative continuations of one prompt (batched, one
round per group of equal length) and chi-square their frequencies against the target's own probabilities; a
deliberately broken acceptance rule must fail the same test, which shows the test has power.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from distill.errors import InputError
from distill.evaluate import reference as R

NUM_SAMPLES = 4000
P_PASS = 1e-3  # a correct rule fails this by chance 0.1% of the time (seeds are fixed, so never flaky)


@pytest.fixture(scope="module")
def models(tiny_target_dir, tiny_draft_dir):
    from distill.models.draft import load_causal_lm

    torch.set_num_threads(1)
    return load_causal_lm(tiny_target_dir).eval(), load_causal_lm(tiny_draft_dir).eval()


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> list[list[int]]:
    texts = ["Explain the moon in two sentences.", "Write python code to sort a list.", "What is a train?"]
    out = []
    for t in texts:
        enc = tiny_tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
        out.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))
    return out


# ---- exact probabilities of the target -----------------------------------------------------------------


@torch.inference_mode()
def _first_token_probs(target, prompt, sampling: R.Sampling) -> np.ndarray:
    logits = target(input_ids=torch.tensor([prompt])).logits[0, -1]
    return R.warp(logits, sampling).double().numpy()


@torch.inference_mode()
def _two_token_probs(target, prompt, sampling: R.Sampling) -> np.ndarray:
    """p(x1, x2) = p(x1) p(x2 | x1) for every pair: [V, V]."""
    p1 = _first_token_probs(target, prompt, sampling)
    vocab = len(p1)
    ids = torch.cat([torch.tensor([prompt]).expand(vocab, -1), torch.arange(vocab).unsqueeze(1)], dim=1)
    p2 = R.warp(target(input_ids=ids, logits_to_keep=1).logits[:, -1], sampling).double().numpy()
    return p1[:, None] * p2


def _chisquare_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit; cells expected below 5 are pooled into one. Impossible cells must be empty."""
    from scipy.stats import chisquare

    counts, probs = counts.ravel().astype(np.float64), probs.ravel()
    assert counts[probs == 0].sum() == 0, "sampled a token the target gives probability 0"
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:  # too small a pool to test on its own: fold it into the smallest tested cell
        j = int(np.argmin(exp[:-1]))
        obs[j] += obs[-1]
        exp[j] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    exp *= obs.sum() / exp.sum()
    assert len(obs) >= 10, "too few cells for a meaningful test"
    return float(chisquare(obs, exp).pvalue)


def _sample(models, prompt, *, num_tokens, sampling, method, seed=0, k=3) -> np.ndarray:
    target, draft = models
    g = torch.Generator().manual_seed(seed)
    out = R.sample_speculative_batch(
        target,
        draft,
        prompt,
        num_samples=NUM_SAMPLES,
        num_tokens=num_tokens,
        k=k,
        sampling=sampling,
        draft_sample_method=method,
        generator=g,
    )
    assert int((out < 0).sum()) == 0
    return out.numpy()


# ---- distribution preserved -----------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_first_token_has_target_distribution(models, prompts, method):
    sampling = R.Sampling(temperature=1.0)
    probs = _first_token_probs(models[0], prompts[0], sampling)
    out = _sample(models, prompts[0], num_tokens=1, sampling=sampling, method=method)
    counts = np.bincount(out[:, 0], minlength=len(probs))
    assert _chisquare_pvalue(counts, probs) > P_PASS


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_first_two_tokens_jointly_have_target_distribution(models, prompts, method):
    """Covers position 2 (accepted draft, residual after an accepted one, bonus at k=1) and a second round."""
    sampling = R.Sampling(temperature=1.0)
    joint = _two_token_probs(models[0], prompts[1], sampling)
    vocab = joint.shape[0]
    for k in (1, 3):
        out = _sample(models, prompts[1], num_tokens=2, sampling=sampling, method=method, k=k, seed=k)
        counts = np.bincount(out[:, 0] * vocab + out[:, 1], minlength=vocab * vocab)
        assert _chisquare_pvalue(counts, joint) > P_PASS, f"k={k}"


def test_temperature_and_top_p_apply_to_both_models(models, prompts):
    sampling = R.Sampling(temperature=0.7, top_p=0.8)
    probs = _first_token_probs(models[0], prompts[2], sampling)
    assert (probs == 0).sum() > 0  # top-p really cut the tail
    out = _sample(models, prompts[2], num_tokens=1, sampling=sampling, method="probabilistic")
    assert _chisquare_pvalue(np.bincount(out[:, 0], minlength=len(probs)), probs) > P_PASS


def test_identical_draft_keeps_the_target_distribution(models, prompts):
    """An identical draft at T=1 (probabilistic) accepts almost all and still samples the target's law."""
    target = models[0]
    sampling = R.Sampling(temperature=1.0)
    joint = _two_token_probs(target, prompts[0], sampling)
    out = _sample((target, target), prompts[0], num_tokens=2, sampling=sampling, method="probabilistic")
    counts = np.bincount(out[:, 0] * joint.shape[0] + out[:, 1], minlength=joint.size)
    assert _chisquare_pvalue(counts, joint) > P_PASS


BROKEN_RULES = {
    "accept_always": lambda p_x, q_x: torch.ones_like(p_x),
    "sqrt_ratio": lambda p_x, q_x: torch.clamp(p_x / q_x, max=1.0).sqrt(),  # subtly too lenient
}


@pytest.mark.parametrize(
    ("rule", "method"),
    [("accept_always", "greedy"), ("accept_always", "probabilistic"), ("sqrt_ratio", "probabilistic")],
)
def test_broken_acceptance_rule_fails_the_same_test(models, prompts, monkeypatch, rule, method):
    monkeypatch.setattr(R, "acceptance_probability", BROKEN_RULES[rule])
    sampling = R.Sampling(temperature=1.0)
    probs = _first_token_probs(models[0], prompts[0], sampling)
    out = _sample(models, prompts[0], num_tokens=1, sampling=sampling, method=method)
    assert _chisquare_pvalue(np.bincount(out[:, 0], minlength=len(probs)), probs) < 1e-6


def test_broken_residual_fails_the_same_test(models, prompts, monkeypatch):
    """Resampling from p instead of norm(max(0, p − q)) after a rejection is a subtle, classic bug."""
    real_verify = R.verify

    def verify_resample_from_p(draft_ids, q, p, generator):
        num_accepted, _ = real_verify(draft_ids, q, p, generator)
        return num_accepted, R.sample(p[torch.arange(len(num_accepted)), num_accepted], generator)

    monkeypatch.setattr(R, "verify", verify_resample_from_p)
    sampling = R.Sampling(temperature=1.0)
    probs = _first_token_probs(models[0], prompts[0], sampling)
    out = _sample(models, prompts[0], num_tokens=1, sampling=sampling, method="probabilistic")
    assert _chisquare_pvalue(np.bincount(out[:, 0], minlength=len(probs)), probs) < 1e-6


# ---- greedy: speculation never changes the output --------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_greedy_speculative_equals_target_greedy(models, prompts, k):
    target, draft = models
    for prompt in prompts:
        ref = R.target_generate(target, prompt, max_tokens=24, eos_token_id=2, sampling=R.Sampling())
        for d in (draft, target):
            gen = R.speculative_generate(
                target, d, prompt, max_tokens=24, eos_token_id=2, k=k, sampling=R.Sampling()
            )
            assert gen.token_ids == ref
        gen = R.speculative_generate(
            target, None, prompt, max_tokens=24, eos_token_id=2, k=k, sampling=R.Sampling(), method="ngram"
        )
        assert gen.token_ids == ref


def test_greedy_drafting_is_exact_at_temperature_above_zero(models, prompts):
    """Greedy drafts at T>0: q is the one-hot of the proposal, so a seeded run equals itself and the counters
    stay consistent; the distribution itself is covered by the chi-square tests."""
    target, draft = models
    gen = R.speculative_generate(
        target,
        draft,
        prompts[0],
        max_tokens=30,
        eos_token_id=2,
        k=3,
        sampling=R.Sampling(1.0),
        draft_sample_method="greedy",
        generator=torch.Generator().manual_seed(0),
    )
    s = gen.stats
    assert 0 < len(gen.token_ids) <= 30
    assert s.num_accepted_tokens == sum(s.accepted_per_pos) <= s.num_draft_tokens == 3 * s.num_drafts
    assert all(a >= b for a, b in zip(s.accepted_per_pos, s.accepted_per_pos[1:], strict=False))


def test_identical_draft_accepts_everything(models, prompts):
    target = models[0]
    greedy = R.speculative_generate(
        target, target, prompts[0], max_tokens=30, eos_token_id=None, k=4, sampling=R.Sampling()
    )
    assert greedy.stats.num_accepted_tokens == greedy.stats.num_draft_tokens > 0
    sampled = R.speculative_generate(
        target,
        target,
        prompts[0],
        max_tokens=60,
        eos_token_id=None,
        k=4,
        sampling=R.Sampling(1.0),
        draft_sample_method="probabilistic",
        generator=torch.Generator().manual_seed(1),
    )
    assert sampled.stats.num_accepted_tokens / sampled.stats.num_draft_tokens > 0.97


def test_stops_at_eos_and_max_tokens(models, prompts):
    target = models[0]
    ref = R.target_generate(target, prompts[0], max_tokens=20, eos_token_id=None, sampling=R.Sampling())
    eos = ref[5]  # pretend the 6th greedy token is EOS: generation must stop right there, EOS included
    for k in (1, 4):
        gen = R.speculative_generate(
            target, target, prompts[0], max_tokens=20, eos_token_id=eos, k=k, sampling=R.Sampling()
        )
        assert gen.token_ids == ref[: ref.index(eos) + 1]
        gen = R.speculative_generate(
            target, target, prompts[0], max_tokens=7, eos_token_id=None, k=k, sampling=R.Sampling()
        )
        assert gen.token_ids == ref[:7]


# ---- parallel (PARD) drafts: one forward proposes k tokens -------------------------------------------

PARALLEL_K = 4


def _parallel(model_dir, tokenizer):
    """A tiny untrained parallel draft: any tiny model marked with a mask id (`mark_parallel`)."""
    from distill.models.draft import choose_mask_token, load_causal_lm, mark_parallel

    model = load_causal_lm(model_dir).eval()
    mark_parallel(model, PARALLEL_K, choose_mask_token(tokenizer))
    return model


@pytest.fixture(scope="module")
def parallel_drafts(tiny_target_dir, tiny_draft_dir, tiny_tokenizer):
    """(a random parallel draft, the target itself as a parallel draft)."""
    return _parallel(tiny_draft_dir, tiny_tokenizer), _parallel(tiny_target_dir, tiny_tokenizer)


@torch.inference_mode()
def test_parallel_proposal_is_one_forward_over_next_token_and_masks(parallel_drafts, prompts):
    """vLLM's layout: [context, next token, mask * (k - 1)], positions continuing, causal; the proposals are
    the argmaxes at next token and each mask, and the cache keeps no mask entry."""
    draft = parallel_drafts[0]
    mask = int(draft.config.pard_token)
    tokens = torch.tensor([prompts[0]])
    cache = R.new_cache(draft)
    R.forward_new(draft, cache, tokens[:, :-3], 1)  # a cached prefix, three new tokens this round
    calls = []
    hook = draft.register_forward_hook(
        lambda mod, args, kwargs, out: calls.append(kwargs["input_ids"]), with_kwargs=True
    )
    try:
        ids, q = R.propose_parallel(
            draft,
            tokens,
            cache,
            k=3,
            mask_id=mask,
            sampling=R.Sampling(),
            draft_sample_method="greedy",
            generator=None,
        )
    finally:
        hook.remove()
    assert len(calls) == 1 and calls[0].tolist() == [[*prompts[0][-3:], mask, mask]]
    assert R.cache_len(cache) == len(prompts[0])
    full = draft(input_ids=torch.tensor([prompts[0] + [mask, mask]])).logits[0, -3:]
    assert ids[0].tolist() == full.argmax(-1).tolist()
    assert torch.equal(q[0], torch.nn.functional.one_hot(ids[0], q.shape[-1]).float())


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_speculative_with_a_parallel_draft_equals_target_greedy(models, parallel_drafts, prompts, k):
    target = models[0]
    for prompt in prompts:
        ref = R.target_generate(target, prompt, max_tokens=24, eos_token_id=2, sampling=R.Sampling())
        for d in parallel_drafts:
            gen = R.speculative_generate(
                target,
                d,
                prompt,
                max_tokens=24,
                eos_token_id=2,
                k=k,
                sampling=R.Sampling(),
                parallel_mask_id=int(d.config.pard_token),
            )
            assert gen.token_ids == ref
            s = gen.stats
            assert s.num_draft_tokens == k * s.num_drafts and s.num_accepted_tokens == sum(s.accepted_per_pos)


def test_target_as_parallel_draft_accepts_its_next_token(models, parallel_drafts, prompts):
    """Position 0 of a parallel round is the draft's ordinary next-token prediction: the target as its own
    draft accepts it every round (its untrained masks may miss)."""
    target, self_draft = models[0], parallel_drafts[1]
    gen = R.speculative_generate(
        target,
        self_draft,
        prompts[1],
        max_tokens=30,
        eos_token_id=None,
        k=3,
        sampling=R.Sampling(),
        parallel_mask_id=int(self_draft.config.pard_token),
    )
    assert gen.stats.accepted_per_pos[0] == gen.stats.num_drafts > 0


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_parallel_draft_keeps_the_target_distribution(models, parallel_drafts, prompts, method):
    """Chi-square on the first two tokens jointly with a parallel draft (k=1 and k=3) at T=1."""
    target, draft = models[0], parallel_drafts[0]
    sampling = R.Sampling(temperature=1.0)
    joint = _two_token_probs(target, prompts[1], sampling)
    vocab = joint.shape[0]
    for k in (1, 3):
        out = R.sample_speculative_batch(
            target,
            draft,
            prompts[1],
            num_samples=NUM_SAMPLES,
            num_tokens=2,
            k=k,
            sampling=sampling,
            draft_sample_method=method,
            generator=torch.Generator().manual_seed(10 + k),
            parallel_mask_id=int(draft.config.pard_token),
        ).numpy()
        counts = np.bincount(out[:, 0] * vocab + out[:, 1], minlength=vocab * vocab)
        assert _chisquare_pvalue(counts, joint) > P_PASS, f"k={k}"


# ---- small pieces ----------------------------------------------------------------------------------------


def test_verify_edge_cases():
    vocab = 8
    one_hot = lambda i: torch.nn.functional.one_hot(torch.tensor(i), vocab).float()  # noqa: E731
    # Target argmax 5 everywhere, draft proposes 5, 5, 7: two accepted, the third replaced by 5.
    draft_ids = torch.tensor([[5, 5, 7]])
    q = torch.stack([one_hot(5), one_hot(5), one_hot(7)]).unsqueeze(0)
    p = torch.stack([one_hot(5)] * 4).unsqueeze(0)
    n, nxt = R.verify(draft_ids, q, p, torch.Generator().manual_seed(0))
    assert (int(n), int(nxt)) == (2, 5)
    # All accepted: the bonus token comes from p at position k.
    p2 = torch.stack([one_hot(5), one_hot(5), one_hot(7), one_hot(3)]).unsqueeze(0)
    n, nxt = R.verify(draft_ids, q, p2, torch.Generator().manual_seed(0))
    assert (int(n), int(nxt)) == (3, 3)


def test_top_p_filter_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert torch.allclose(R.top_p_filter(probs, 0.8), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    assert torch.allclose(R.top_p_filter(probs, 0.81), torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    assert torch.allclose(R.top_p_filter(probs, 0.1), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_ngram_proposal():
    assert R.ngram_proposal([1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]
    assert R.ngram_proposal([1, 2, 5, 1, 2, 7, 1, 2], 3) == [7, 1, 2]  # the most recent match
    assert R.ngram_proposal([4, 1, 2, 8, 3, 1, 2], 2, ngram_max=4) == [8, 3]
    assert R.ngram_proposal([5, 6, 7, 8], 3) == []
    assert R.ngram_proposal([7, 1, 2, 3, 1, 2, 3], 2, ngram_max=3) == [1, 2]  # longest suffix wins


# ---- the job entry point ---------------------------------------------------------------------------------

RESULT_KEYS = {
    "name",
    "method",
    "draft",
    "k",
    "temperature",
    "draft_sample_method",
    "parallel_drafting",
    "heterogeneous_vocab",
    "startup_s",
    "wall_s",
    "output_tokens",
    "output_tokens_per_pass",
    "num_drafts",
    "num_draft_tokens",
    "num_accepted_tokens",
    "accepted_per_pos",
    "texts",
    "token_ids",
    "error",
    "load_avg",
    "foreign_cpu",
}


def _job(target, draft, prompts, **extra):
    configs = [
        {
            "name": "no_spec",
            "method": None,
            "draft": None,
            "k": 0,
            "temperature": 0.0,
            "draft_sample_method": None,
        },
        {
            "name": "base",
            "method": "draft_model",
            "draft": str(draft),
            "k": 3,
            "temperature": 0.0,
            "draft_sample_method": "greedy",
        },
        {
            "name": "ngram",
            "method": "ngram",
            "draft": None,
            "k": 2,
            "temperature": 0.0,
            "draft_sample_method": None,
        },
        {
            "name": "self",
            "method": "draft_model",
            "draft": str(target),
            "k": 2,
            "temperature": 1.0,
            "draft_sample_method": "probabilistic",
        },
    ]
    return {
        "target": str(target),
        "dtype": "float32",
        "prompts": prompts,
        "max_tokens": 16,
        "eos_token_id": [2],
        "configs": configs,
        "repeats": 2,
        "seed": 0,
        "stage_extra_key": 1,
        **extra,
    }


def test_run_reference_job(tiny_target_dir, tiny_draft_dir, prompts, tmp_path):
    partial = tmp_path / "partial.json"
    out = R.run_reference_job(_job(tiny_target_dir, tiny_draft_dir, prompts, partial_path=str(partial)))
    assert out["engine"] == "hf" and out["device"] == "cpu" and "torch" in out["engine_version"]
    by_name = {r["name"]: r for r in out["results"]}
    for r in out["results"]:
        assert set(r) == RESULT_KEYS
        assert r["error"] is None and len(r["wall_s"]) == 2 and all(w > 0 for w in r["wall_s"])
        assert r["startup_s"] > 0 and len(r["texts"]) == len(r["token_ids"]) == len(prompts)
        assert r["output_tokens"] == sum(len(t) for t in r["token_ids"]) > 0
        assert r["output_tokens_per_pass"] == [r["output_tokens"]] * 2
        assert len(r["accepted_per_pos"]) == r["k"]
        assert r["num_accepted_tokens"] == sum(r["accepted_per_pos"]) <= r["num_draft_tokens"]
    assert by_name["no_spec"]["num_drafts"] == 0 and by_name["no_spec"]["accepted_per_pos"] == []
    # T=0: speculation must not change the text.
    assert by_name["base"]["texts"] == by_name["no_spec"]["texts"] == by_name["ngram"]["texts"]
    assert by_name["base"]["num_draft_tokens"] == 3 * by_name["base"]["num_drafts"] > 0
    s = by_name["self"]
    assert s["num_accepted_tokens"] / s["num_draft_tokens"] > 0.9
    saved = json.loads(partial.read_text())
    assert saved["complete"] is False and [r["name"] for r in saved["results"]] == list(by_name)


def test_run_reference_job_with_a_parallel_draft(tiny_target_dir, tiny_tokenizer, prompts, tmp_path):
    from distill.models.draft import save_hf_folder

    folder = save_hf_folder(_parallel(tiny_target_dir, tiny_tokenizer), tiny_tokenizer, tmp_path / "pard")
    job = _job(tiny_target_dir, folder, prompts[:2], repeats=1)
    par = dict(job["configs"][1], name="pard", k=2, parallel_drafting=True)
    not_pard = dict(par, name="not_pard", draft=str(tiny_target_dir))  # no pard_token in its config
    job["configs"] = [job["configs"][0], par, not_pard]
    out = R.run_reference_job(job)
    no_spec, pard, bad = out["results"]
    assert (
        pard["error"] is None and pard["parallel_drafting"] is True and no_spec["parallel_drafting"] is False
    )
    assert pard["texts"] == no_spec["texts"]
    assert pard["num_draft_tokens"] == 2 * pard["num_drafts"] > 0
    assert bad["error"] and "pard_token" in bad["error"]


def test_a_failing_configuration_is_marked_and_the_others_run(
    tiny_target_dir, tiny_draft_dir, prompts, tmp_path
):
    broken = tmp_path / "broken_draft"
    broken.mkdir()  # a folder, so the job validates, but no weights in it
    job = _job(tiny_target_dir, tiny_draft_dir, prompts[:1], repeats=1)
    job["configs"] = [job["configs"][0], dict(job["configs"][1], draft=str(broken)), job["configs"][2]]
    out = R.run_reference_job(job)
    errors = [r["error"] for r in out["results"]]
    assert errors[0] is None and errors[2] is None and errors[1]
    assert out["results"][1]["output_tokens"] == 0 and out["results"][1]["wall_s"] == []


def test_run_reference_job_is_reproducible_at_temperature(tiny_target_dir, tiny_draft_dir, prompts):
    job = _job(tiny_target_dir, tiny_draft_dir, prompts[:2], repeats=1)
    job["configs"] = [dict(job["configs"][1], temperature=1.0, draft_sample_method="probabilistic")]
    a, b = R.run_reference_job(job), R.run_reference_job(job)
    assert a["results"][0]["token_ids"] == b["results"][0]["token_ids"]


def test_bad_jobs_name_the_problem(tiny_target_dir, tiny_draft_dir, tmp_path, prompts):
    job = _job(tiny_target_dir, tiny_draft_dir, prompts)
    job["configs"][1]["k"] = 0
    job["configs"][2]["draft_sample_method"] = "beam"
    job["configs"][3]["draft"] = str(tmp_path / "missing")
    with pytest.raises(InputError) as err:
        R.run_reference_job(job)
    msg = str(err.value)
    assert "configs[base].k" in msg and "draft_sample_method" in msg and "configs[self].draft" in msg
    with pytest.raises(InputError, match="prompts"):
        R.run_reference_job({**job, "prompts": [], "configs": job["configs"][:1]})


def test_rounds_run_every_configuration_in_turn_and_pool_the_passes(
    tiny_target_dir, tiny_draft_dir, prompts, tmp_path
):
    job = _job(tiny_target_dir, tiny_draft_dir, prompts[:2], repeats=1, rounds=2)
    job["configs"] = job["configs"][:2]
    out = R.run_reference_job(job)
    no_spec, base = out["results"]
    for r in (no_spec, base):
        assert r["error"] is None and len(r["wall_s"]) == 2 and r["round_of_pass"] == [0, 1]
        assert len(r["startup_s_per_round"]) == 2
    one = R.run_reference_job(dict(job, rounds=1))["results"][1]
    # counters summed over the rounds: twice one round's (T=0, same prompts: identical passes)
    assert base["num_drafts"] == 2 * one["num_drafts"] > 0
    assert base["accepted_per_pos"] == [2 * a for a in one["accepted_per_pos"]]
    assert base["texts"] == one["texts"]
