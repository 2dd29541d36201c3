"""The EAGLE-1 head study (bench/bench_eagle.py): alignment, the identity start, vLLM's weight names, a short
training on a tiny target, input errors, and the driver around a faked vLLM worker."""

from __future__ import annotations

import json

import pytest
from model_folders import data_run_dir

from bench import bench_eagle as be


def test_aligned_pairs_next_token_with_current_state():
    import torch

    b, length, h = 2, 6, 3
    pos = torch.arange(length, dtype=torch.float32)
    hidden = pos.view(1, length, 1).expand(b, length, h)  # h_t carries t
    embeds = 100 + pos.view(1, length, 1).expand(b, length, h)  # emb(x_t) carries 100 + t
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 0]], dtype=torch.bool)
    next_embeds, hidden_in, hidden_next, scored = be.aligned(hidden, embeds, mask)
    assert next_embeds.shape == hidden_in.shape == (b, length - 1, h)
    assert hidden_next.shape == (b, length - 2, h) and scored.shape == (b, length - 2)
    t = torch.arange(length - 1, dtype=torch.float32)
    assert torch.equal(next_embeds[0, :, 0], 100 + t + 1)  # position t reads x_{t+1} ...
    assert torch.equal(hidden_in[0, :, 0], t)  # ... and h_t
    assert torch.equal(hidden_next[0, :, 0], t[:-1] + 1)  # and is matched to h_{t+1}
    assert scored[1].tolist() == [1, 1, 1, 0]  # scored where x_{t+2} is a response token


def test_head_starts_as_identity_and_exports_vllm_names(tiny_target_dir, tmp_path):
    import torch
    from safetensors.torch import load_file

    from distill.models.draft import load_causal_lm

    target = load_causal_lm(tiny_target_dir).eval()
    head = be.build_head(target, num_layers=1, init_layer=-1)
    hidden = torch.randn(2, 5, target.config.hidden_size)
    f = head(torch.randn_like(hidden), hidden, torch.ones(2, 5, dtype=torch.long))
    assert torch.allclose(f, hidden, atol=1e-6)  # step 0 predicts what the target predicted at t

    names = set(be.head_state_dict(head))
    assert "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names
    assert "layers.0.post_attention_layernorm.weight" in names
    assert not any(
        "input_layernorm" in n or "embed" in n or "lm_head" in n or n.startswith("norm") for n in names
    )

    out = be.save_head(head, tiny_target_dir, tmp_path / "head", "float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["architectures"] == ["EagleLlamaForCausalLM"]
    assert set(load_file(out / "model.safetensors")) == names
    with pytest.raises(ValueError, match="--init-layer"):
        be.build_head(target, num_layers=1, init_layer=99)


def test_short_training_learns_the_shift(tiny_target_dir, tiny_tokenizer, tmp_path):
    run = data_run_dir(tmp_path / "run", tiny_tokenizer)
    out = tmp_path / "out"
    rc = be.main(
        [
            "--quick", "--no-vllm", "--run-dir", str(run), "--target", str(tiny_target_dir),
            "--steps", "40", "--batch-size", "8", "--lr", "3e-3", "--warmup", "5", "--val-every", "20",
            "--dtype", "float32", "--out-dir", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    payload = json.loads((out / "eagle.json").read_text())
    val = payload["history"]["val_top1"]
    assert [v["step"] for v in val] == [0, 20, 40]
    train = payload["history"]["train"]
    assert train[-1]["fkl"] < 0.7 * train[0]["fkl"]  # it learns the one-token shift from the identity start
    assert val[-1]["top1"] > val[0]["top1"]
    assert payload["vllm"] is None and "bench.bench_eagle" in payload["command"]
    assert (out / "work" / "eagle" / "head" / "model.safetensors").is_file()
    assert "validation top-1" in (out / "eagle.md").read_text()


def test_missing_data_is_exit_2_naming_the_option(tmp_path, capsys):
    rc = be.main(["--quick", "--no-vllm", "--run-dir", str(tmp_path / "nowhere"), "--out-dir", str(tmp_path)])
    assert rc == 2
    assert "--run-dir" in capsys.readouterr().err
    assert not (tmp_path / "eagle.json").exists()


def test_speculate_job_measures_no_spec_then_each_k(tmp_path):
    args = be.parse_args(["--quick", "--k", "1", "3", "--out-dir", str(tmp_path)])
    args.eos_token_id = 2
    job = be.speculate_job("T", "H", [[1, 2, 3]], args.k, args)
    assert [(c["name"], c["method"], c["k"]) for c in job["configs"]] == [
        ("no_spec", None, 0),
        ("eagle", "eagle", 1),
        ("eagle", "eagle", 3),
    ]
    assert all(c["draft"] == "H" for c in job["configs"][1:]) and job["enforce_eager"] is False
    assert job["repeats"] == 3 and job["max_num_seqs"] == 1


def fake_engine_output(job):
    """What the vLLM worker returns for `job`: no_spec at 100 tokens/s, the head at 150 accepting 60%."""
    results = []
    for c in job["configs"]:
        k, drafts = c["k"], (40 if c["method"] else 0)
        accepted = [int(0.6 * drafts)] * k
        wall = 1.0 if c["method"] is None else 2 / 3
        results.append(
            {
                **c,
                "startup_s": 5.0,
                "wall_s": [wall] * job["repeats"],
                "output_tokens": 100,
                "output_tokens_per_pass": [100] * job["repeats"],
                "num_drafts": drafts,
                "num_draft_tokens": drafts * k,
                "num_accepted_tokens": sum(accepted),
                "accepted_per_pos": accepted,
                "token_ids": [[1]] * len(job["prompts"]),
                "error": None,
            }
        )
    return {"engine": "vllm", "complete": True, "results": results}


def test_quick_study_times_its_exported_head_through_the_worker(
    tiny_target_dir, tiny_tokenizer, tmp_path, monkeypatch
):
    """The driver end to end with the engine faked: the job names the exported head (that it runs inside real
    vLLM is tests/test_eval_eagle.py's, whose heads are this bench's export) and the rows get speedups."""
    jobs = []

    def run_worker(job, *, log_path, timeout_s, env=None, what=""):
        jobs.append(job)
        return fake_engine_output(job)

    monkeypatch.setattr("distill.utils.subproc.run_worker", run_worker)
    monkeypatch.setattr("distill.utils.subproc.vllm_available", lambda: True)
    run, out = data_run_dir(tmp_path / "run", tiny_tokenizer), tmp_path / "out"
    rc = be.main(
        [
            "--quick", "--run-dir", str(run), "--target", str(tiny_target_dir), "--steps", "2",
            "--batch-size", "4", "--dtype", "float32", "--k", "2", "--out-dir", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    head = out / "work" / "eagle" / "head"
    [job] = jobs
    assert job["target"] == str(tiny_target_dir) and job["configs"][1]["draft"] == str(head)
    assert len(job["prompts"]) == 2 and job["dtype"] == "float32"
    rows = json.loads((out / "eagle.json").read_text())["vllm"]
    assert [(r["name"], r["k"]) for r in rows] == [("no_spec", 0), ("eagle", 2)]
    assert rows[1]["speedup"] == pytest.approx(1.5) and len(rows[1]["per_position_acceptance"]) == 2
    assert "| eagle | 2 |" in (out / "eagle.md").read_text()
