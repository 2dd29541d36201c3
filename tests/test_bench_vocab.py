"""bench_vocab on a tiny run: coverage, top-1 through the full-vocabulary view, head timing, export."""

from __future__ import annotations

import json

from model_folders import data_run_dir

from bench import bench_vocab as bv


def test_bench_on_a_tiny_run(tiny_target_dir, tiny_tokenizer, tmp_path):
    run = data_run_dir(tmp_path / "run", tiny_tokenizer, n_train=6, n_val=4)
    out = tmp_path / "out"
    rc = bv.main(
        [
            "--run-dir", str(run), "--draft", str(tiny_target_dir), "--sizes", "300,400", "--repeats", "3",
            "--export", str(tmp_path / "trimmed"), "--out-dir", str(out), "--name", "vocab-test",
        ]
    )  # fmt: skip
    assert rc == 0
    payload = json.loads((out / "vocab-test.json").read_text())
    sizes = {e["size"]: e for e in payload["sizes"]}
    assert set(sizes) == {300, 400} and payload["full"]["size"] == 512
    for e in sizes.values():
        # The training rows' tokens come first; the validation rows share most of them.
        assert 0.5 < e["val_token_share"] <= 1.0 and e["head_ms"] > 0
        assert 0.0 <= e["top1"] <= 1.0 and e["head_ratio"] > 0
    exported = json.loads((tmp_path / "trimmed" / "draft-300" / "config.json").read_text())
    assert exported["vocab_size"] == 300
    assert "| 300 |" in (out / "vocab-test.md").read_text()


def test_bad_input_is_one_message(tmp_path, capsys, tiny_target_dir, tiny_tokenizer):
    run = data_run_dir(tmp_path / "run", tiny_tokenizer, n_train=2, n_val=2)
    assert bv.main(["--run-dir", str(run), "--draft", str(tmp_path / "nowhere")]) == 2
    assert "--draft" in capsys.readouterr().err
    assert bv.main(["--run-dir", str(run), "--draft", str(tiny_target_dir), "--sizes", "600"]) == 2
    assert "--sizes: 600 is not below" in capsys.readouterr().err
    assert bv.main(["--run-dir", str(run), "--draft", str(tiny_target_dir), "--sizes", "10"]) == 2
    assert "--sizes: 10 is too small" in capsys.readouterr().err


def test_vllm_command_measures_the_exported_drafts_beside_the_full_one(tmp_path):
    args = bv.parse_args(["--export", str(tmp_path), "--vllm", "--vllm-prompts", "8", "--vllm-rounds", "2"])
    command = bv.vllm_command(
        args, tmp_path / "full", [{"size": 8192, "exported": str(tmp_path / "draft-8192")}]
    )
    assert command[1:6] == ["-m", "bench.bench_eval", "--phase", "t0", "--tag"]
    drafts = next(c for c in command if c.startswith("eval.drafts="))
    assert f"{{name: full, model: '{tmp_path / 'full'}', k: [3]}}" in drafts
    assert f"{{name: vocab-8192, model: '{tmp_path / 'draft-8192'}', k: [3]}}" in drafts
    assert {"eval.num_prompts=8", "eval.rounds=2", "eval.ngram=false"} <= set(command)


def test_vllm_needs_export(capsys):
    import pytest

    with pytest.raises(SystemExit) as exc:
        bv.parse_args(["--vllm"])
    assert exc.value.code == 2 and "--export" in capsys.readouterr().err
