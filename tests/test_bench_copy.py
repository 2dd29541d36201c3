"""The copying study (bench/bench_copy.py): vLLM's prompt-lookup rule, the grouping of response positions, the
induction scores on an oracle model, and the whole bench on a tiny run folder."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
from model_folders import data_run_dir

from bench import bench_copy as bc


def test_prompt_lookup_prefers_the_longest_ngram_then_its_earliest_occurrence():
    # "1 2" occurs at 0 (followed by 3) and at 3 (followed by 4); "9 1 2" only at 2 (followed by 4).
    assert bc.prompt_lookup([1, 2, 3, 1, 2, 4, 1, 2], 2, 5) == (3, 2)
    assert bc.prompt_lookup([5, 9, 1, 2, 4, 9, 1, 2], 2, 5) == (4, 3)
    assert bc.prompt_lookup([5, 9, 1, 2, 4, 9, 1, 2], 2, 2) == (4, 2)
    assert bc.prompt_lookup([1, 2, 3, 4], 2, 5) is None  # no repeated suffix
    assert bc.prompt_lookup([7, 7], 2, 5) is None  # the suffix itself is not an earlier occurrence
    assert bc.prompt_lookup([7, 7, 7], 2, 5) == (7, 2)  # overlapping occurrences count


def test_prompt_lookup_matches_vllms_proposer():
    proposer = pytest.importorskip("vllm.v1.spec_decode.ngram_proposer")
    np = pytest.importorskip("numpy")
    rng = random.Random(0)
    checked = 0
    for _ in range(400):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(2, 40))]  # 4 ids: many repeats
        lo, hi = rng.choice([(1, 3), (2, 5), (3, 4)])
        got = bc.prompt_lookup(tokens, lo, hi)
        ref = proposer._find_longest_matched_ngram_and_propose_tokens(
            np.array(tokens, dtype=np.int32), lo, hi, 4096, 1
        )
        assert (got[0] if got else None) == (int(ref[0]) if len(ref) else None), (tokens, lo, hi)
        checked += got is not None
    assert checked > 200  # the rule was exercised, not only the no-match case


def test_row_groups_label_each_response_token():
    # prompt: 1 2 3 ; response: 1 2 3 (lookup right, 3-gram at the end) then 9 (lookup says 1: wrong)
    ids = [1, 2, 3, 1, 2, 3, 9]
    mask = [0, 0, 0, 1, 1, 1, 1]
    groups = dict(bc.row_groups(ids, mask, 2, 3))
    assert groups == {3: "no_proposal", 4: "no_proposal", 5: "copy_right_shorter", 6: "copy_wrong"}
    ids = [1, 2, 3, 4, 1, 2, 3, 4]
    groups = dict(bc.row_groups(ids, [0, 0, 0, 0, 1, 1, 1, 1], 2, 3))
    assert groups[6] == "copy_right_shorter" and groups[7] == "copy_right_max_n"


def test_counts_and_summary():
    counts = bc.empty_counts()
    ids = [1, 2, 3, 1, 2, 3, 9]
    groups = bc.row_groups(ids, [0, 0, 0, 1, 1, 1, 1], 2, 3)
    predicted = [0, 0, 1, 0, 3, 0, 0]  # right at t=3 (predicted[2] = 1) and t=5 (predicted[4] = 3)
    bc.add_row(counts, groups, predicted, ids)
    s = bc.summarize_counts(counts)
    assert s["positions"] == 4 and s["top1"] == 0.5
    assert s["top1_with_lookup_copies"] == 0.5  # lookup's one right copy (t=5) the model already had
    bc.add_row(counts, groups, [0] * 7, ids)  # a second row where the model gets nothing right
    s = bc.summarize_counts(counts)
    assert s["top1"] == 0.25 and s["top1_with_lookup_copies"] == 0.375  # + lookup's right copy at t=5
    assert s["groups"]["no_proposal"] == {"positions": 4, "share": 0.5, "top1": 0.25}
    assert s["groups"]["copy_right_shorter"]["top1"] == 0.5
    assert s["groups"]["copy_wrong"]["top1"] == 0.0
    assert s["groups"]["copy_right_max_n"] == {"positions": 0, "share": 0.0, "top1": None}


class Oracle:
    """A 'model' that copies perfectly: it predicts the token after the earlier occurrence, and one head of its
    one layer attends exactly there (the other attends to the previous token)."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __call__(self, x, use_cache=False, output_attentions=False):
        import torch

        b, n = x.shape
        length = (n - 1) // 2
        logits = torch.zeros(b, n, self.vocab)
        att = torch.zeros(b, 2, n, n)
        for q in range(length + 1, n):
            src = q - length + 1  # the token after the earlier occurrence of x[q] (= x[q - length])
            logits[torch.arange(b), q, x[:, src]] = 1.0
            att[:, 0, q, src] = 1.0
            att[:, 1, q, q - 1] = 1.0
        return SimpleNamespace(logits=logits, attentions=(att,) if output_attentions else None)


def test_induction_scores_an_oracle_copier_fully():
    x = bc.repeated_random_tokens(3, 10, 5, 50, bos=1, seed=0)
    assert x.shape == (3, 21) and bool((x[:, 0] == 1).all()) and bool((x[:, 1:11] == x[:, 11:]).all())
    r = bc.induction(Oracle(50), x, 10, attention=True)
    assert r["copy_accuracy"] == 1.0
    (layer,) = r["layers"]
    assert layer["induction"] == 1.0 and layer["induction_head"] == 0
    assert layer["previous_token"] == 1.0 and layer["previous_token_head"] == 1


def test_bench_on_a_tiny_run(tiny_target_dir, tiny_draft_dir, tiny_tokenizer, tmp_path):
    run = data_run_dir(tmp_path / "run", tiny_tokenizer, n_train=4, n_val=6)
    out = tmp_path / "out"
    rc = bc.main(
        [
            "--run-dir", str(run), "--target", str(tiny_target_dir), "--drafts",
            f"a={tiny_draft_dir},same={tiny_target_dir}", "--induction-seqs", "2", "--induction-len", "8",
            "--out-dir", str(out), "--name", "copy-test",
        ]
    )  # fmt: skip
    assert rc == 0
    payload = json.loads((out / "copy-test.json").read_text())
    split = payload["lookup_split"]
    assert set(split) == {"a", "same"}
    assert split["a"]["positions"] == split["same"]["positions"] > 0
    assert sum(g["positions"] for g in split["a"]["groups"].values()) == split["a"]["positions"]
    layers = json.loads((tiny_target_dir / "config.json").read_text())["num_hidden_layers"]
    ind = payload["induction"]
    assert len(ind["target"]["layers"]) == len(ind["same"]["layers"]) == layers
    assert ind["same"]["copy_accuracy"] == ind["target"]["copy_accuracy"]  # the same weights, the same figure
    assert "| lookup right, longest n-gram (5) |" in (out / "copy-test.md").read_text()


def test_bad_input_is_one_message(tmp_path, capsys, tiny_target_dir, tiny_tokenizer):
    assert bc.main(["--run-dir", str(tmp_path / "nowhere"), "--target", str(tiny_target_dir)]) == 2
    assert "--run-dir" in capsys.readouterr().err
    run = data_run_dir(tmp_path / "run", tiny_tokenizer, n_train=2, n_val=2)
    args = ["--run-dir", str(run), "--target", str(tiny_target_dir)]
    assert bc.main([*args, "--drafts", f"x={tmp_path / 'nowhere'}"]) == 2
    assert "--drafts x" in capsys.readouterr().err
    assert bc.main([*args, "--drafts", "no-path"]) == 2
    assert "is not name=path" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        bc.main(["--min-n", "4", "--max-n", "3"])
    assert exc.value.code == 2
