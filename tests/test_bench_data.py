"""bench_data: which overrides each pass gets, the alternation of engines and modes, the summary arithmetic,
the input checks and the output files (no generation here: `distill data` is faked)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from bench import bench_data


def _fake_stage(rates: list[float], calls: list[tuple[str, tuple[str, ...]]]) -> Any:
    it = iter(rates)

    def fake(run_dir: Path, engine: str, args: Any, extra: tuple[str, ...] = ()) -> dict[str, Any]:
        calls.append((run_dir.name, extra))
        return {
            "engine": engine,
            "tokens_per_s": next(it),
            "response_tokens": 600,
            "generation_s": 50.0,
            "wall_s_including_startup": 80.0,
            "startup_s": 30.0,
        }

    return fake


def test_eager_study_alternates_modes_and_summarises(monkeypatch, tmp_path):
    calls: list[tuple[str, tuple[str, ...]]] = []
    # eager-0, compiled-0, then the order reversed: compiled-1, eager-1
    monkeypatch.setattr(bench_data, "run_stage", _fake_stage([400.0, 500.0, 520.0, 410.0], calls))
    monkeypatch.setattr(
        bench_data, "agreement", lambda a, b: 0.25 if {a.name, b.name} == {"eager-0", "compiled-0"} else -1
    )
    out = bench_data.eager_study(tmp_path, argparse.Namespace(repeats=2))
    assert calls == [
        ("eager-0", ("data.vllm_enforce_eager=true",)),
        ("compiled-0", ("data.vllm_enforce_eager=false",)),
        ("compiled-1", ("data.vllm_enforce_eager=false",)),
        ("eager-1", ("data.vllm_enforce_eager=true",)),
    ]
    assert out["eager"]["tokens_per_s_median"] == 405.0
    assert (out["compiled"]["tokens_per_s_min"], out["compiled"]["tokens_per_s_max"]) == (500.0, 520.0)
    assert out["eager"]["startup_s_median"] == 30.0
    per_repeat = out["compiled_over_eager_per_repeat"]
    assert (per_repeat["min"], per_repeat["max"], per_repeat["n"]) == (1.25, round(520 / 410, 3), 2)
    assert out["compiled_over_eager"] == per_repeat["median"]
    assert out["identical_responses"] == 0.25


def _patch_rest(monkeypatch) -> None:
    monkeypatch.setattr(bench_data, "agreement", lambda a, b: 1.0)
    monkeypatch.setattr(
        bench_data,
        "cache_sizes",
        lambda run_dir, ks, codecs, rows: [
            {
                "k": k,
                "codec": c,
                "tokens": 100,
                "bytes_per_token": 10.0 * k,
                "naive_bytes_per_token": 4 * k + 4,
            }
            for k in ks
            for c in codecs
        ],
    )


def test_engines_alternate_over_repeats_and_the_ratio_is_per_repeat(monkeypatch, tmp_path):
    calls: list[tuple[str, tuple[str, ...]]] = []
    # hf-0, vllm-0 | vllm-1, hf-1 | hf-2, vllm-2; the machine slows down in repeat 1 (both engines did)
    rates = [100.0, 200.0, 150.0, 50.0, 100.0, 250.0]
    monkeypatch.setattr(bench_data, "run_stage", _fake_stage(rates, calls))
    _patch_rest(monkeypatch)
    out = tmp_path / "data.json"
    assert bench_data.main(["--repeats", "3", "--ks", "16", "--out", str(out)]) == 0
    assert [c[0] for c in calls] == ["hf-0", "vllm-0", "vllm-1", "hf-1", "hf-2", "vllm-2"]
    g = json.loads(out.read_text())["generation"]
    assert g["vllm_over_hf_per_repeat"] == {"median": 2.5, "min": 2.0, "max": 3.0, "n": 3, "spread_pct": 40.0}
    assert g["vllm_over_hf"] == 2.5
    assert (g["hf"]["tokens_per_s_median"], g["hf"]["tokens_per_s_min"], g["hf"]["n"]) == (100.0, 50.0, 3)
    assert g["vllm"]["tokens_per_s_median"] == 200.0


def test_output_records_command_machine_and_markdown(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_data, "run_stage", _fake_stage([100.0, 240.0], []))
    _patch_rest(monkeypatch)
    out = tmp_path / "data.json"
    argv = ["--repeats", "1", "--ks", "16,64", "--codecs", "zlib", "--out", str(out)]
    assert bench_data.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["command"] == "python -m bench.bench_data " + " ".join(argv)
    assert data["machine"]["date"].endswith("Z") and data["machine"]["cores"]
    md = (tmp_path / "data.md").read_text()
    assert "| hf | 600 | 100.0 (100.0–100.0, n=1) | 50.0 | 30.0 |" in md
    assert "vLLM / hf tokens/s, per repeat: **2.40x** (2.40–2.40, n=1)" in md
    assert "| 64 | 640.0 | 260 |" in md and "Command: `python -m bench.bench_data" in md


def _must_not_run(*args: Any, **kwargs: Any) -> dict[str, Any]:
    raise AssertionError("generation ran before the input checks")


@pytest.mark.parametrize(
    "argv",
    [
        ["--eager-study", "--repeats", "0"],
        ["--repeats", "0"],
        ["--ks", "16,x"],
        ["--ks", ""],
        ["--codecs", "zlib,gzip"],
        ["--prompts", "0"],
    ],
)
def test_bad_input_is_exit_2_before_any_generation(monkeypatch, tmp_path, capsys, argv):
    monkeypatch.setattr(bench_data, "run_stage", _must_not_run)
    with pytest.raises(SystemExit) as exc:
        bench_data.main([*argv, "--out", str(tmp_path / "data.json")])
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err
    assert not (tmp_path / "data.json").exists()


def test_a_non_empty_workdir_is_refused(monkeypatch, tmp_path, capsys):
    """A finished build there would make `distill data` say "already complete" and the bench would report the
    old manifest's tokens/s as new."""
    work = tmp_path / "work"
    (work / "hf-0" / "data").mkdir(parents=True)
    (work / "hf-0" / "data" / "manifest.json").write_text("{}")
    monkeypatch.setattr(bench_data, "run_stage", _must_not_run)
    with pytest.raises(SystemExit) as exc:
        bench_data.main(["--workdir", str(work), "--out", str(tmp_path / "data.json")])
    assert exc.value.code == 2 and "--workdir" in capsys.readouterr().err


def test_an_input_error_of_distill_data_keeps_exit_2(monkeypatch, tmp_path, capsys):
    import distill.cli

    monkeypatch.setattr(distill.cli, "main", lambda argv: 2)
    assert bench_data.main(["--repeats", "1", "--out", str(tmp_path / "data.json")]) == 2
    assert "engine=hf failed (exit 2)" in capsys.readouterr().err
    assert not (tmp_path / "data.json").exists()


def test_batch_study_keeps_the_teacher_cache_and_compares_each_size_to_the_first(monkeypatch, tmp_path):
    calls: list[tuple[str, tuple[str, ...]]] = []
    # batch-64-0, batch-128-0 | batch-128-1, batch-64-1
    monkeypatch.setattr(bench_data, "run_stage", _fake_stage([500.0, 600.0, 560.0, 400.0], calls))
    out = tmp_path / "b.json"
    assert bench_data.main(["--batch-sizes", "64,128", "--repeats", "2", "--out", str(out)]) == 0
    assert calls == [
        ("batch-64-0", ("data.batch_size=64",)),
        ("batch-128-0", ("data.batch_size=128",)),
        ("batch-128-1", ("data.batch_size=128",)),
        ("batch-64-1", ("data.batch_size=64",)),
    ]
    b = json.loads(out.read_text())["batch_study"]
    assert b["sizes"] == [64, 128] and "over_first_per_repeat" not in b["batch-64"]
    assert b["batch-128"]["over_first_per_repeat"] == {
        "median": 1.3,
        "min": 1.2,
        "max": 1.4,
        "n": 2,
        "spread_pct": 15.4,
    }
    md = (tmp_path / "b.md").read_text()
    assert "batch-128 / batch-64 tokens/s, per repeat: **1.30x** (1.20–1.40, n=2)" in md
    assert "the shipped config's top-k cache from vLLM" in md


def test_only_the_batch_study_keeps_the_shipped_teacher_cache(monkeypatch, tmp_path):
    import distill.cli

    seen: list[list[str]] = []
    monkeypatch.setattr(distill.cli, "main", lambda argv: seen.append(argv) or 2)
    for extra in ([], ["--batch-sizes", "64,128"]):
        bench_data.main(["--repeats", "1", *extra, "--out", str(tmp_path / "x.json")])
    assert "data.logits.top_k=0" in seen[0] and not any(a.startswith("data.logits") for a in seen[1])


@pytest.mark.parametrize(
    "sizes", [["--batch-sizes", "64"], ["--batch-sizes", "64,64"], ["--batch-sizes", "64,0"]]
)
def test_bad_batch_sizes_are_exit_2_before_any_generation(monkeypatch, tmp_path, capsys, sizes):
    monkeypatch.setattr(bench_data, "run_stage", _must_not_run)
    with pytest.raises(SystemExit) as exc:
        bench_data.main([*sizes, "--out", str(tmp_path / "b.json")])
    assert exc.value.code == 2 and "--batch-sizes" in capsys.readouterr().err


def test_stream_study_alternates_modes_keeps_the_teacher_cache_and_summarises(monkeypatch, tmp_path):
    import distill.cli

    calls: list[tuple[str, tuple[str, ...]]] = []
    # per-batch-0, streamed-0 | streamed-1, per-batch-1
    monkeypatch.setattr(bench_data, "run_stage", _fake_stage([500.0, 550.0, 480.0, 400.0], calls))
    monkeypatch.setattr(
        bench_data, "agreement", lambda a, b: 0.5 if {a.name, b.name} == {"streamed-0", "per-batch-0"} else -1
    )
    out = tmp_path / "s.json"
    assert bench_data.main(["--stream-study", "--repeats", "2", "--out", str(out)]) == 0
    assert calls == [
        ("per-batch-0", ("data.vllm_stream=false",)),
        ("streamed-0", ("data.vllm_stream=true",)),
        ("streamed-1", ("data.vllm_stream=true",)),
        ("per-batch-1", ("data.vllm_stream=false",)),
    ]
    st = json.loads(out.read_text())["stream_study"]
    assert st["streamed_over_per_batch_per_repeat"] == {
        "median": 1.15,
        "min": 1.1,
        "max": 1.2,
        "n": 2,
        "spread_pct": 8.7,
    }
    assert st["streamed_over_per_batch"] == 1.15 and st["identical_responses"] == 0.5
    md = (tmp_path / "s.md").read_text()
    assert "streamed / per-batch tokens/s, per repeat: **1.15x** (1.10–1.20, n=2)" in md
    assert "the shipped config's top-k cache" in md
    # The real run_stage keeps the shipped config's top-k cache for this study.
    monkeypatch.undo()
    seen: list[list[str]] = []
    monkeypatch.setattr(distill.cli, "main", lambda argv: seen.append(argv) or 2)
    bench_data.main(["--stream-study", "--repeats", "1", "--out", str(tmp_path / "y.json")])
    assert not any(a.startswith("data.logits") for a in seen[0])


@pytest.mark.parametrize(
    "studies",
    [["--stream-study", "--eager-study"], ["--stream-study", "--batch-sizes", "64,128"]],
)
def test_two_studies_at_once_are_exit_2(monkeypatch, tmp_path, capsys, studies):
    monkeypatch.setattr(bench_data, "run_stage", _must_not_run)
    with pytest.raises(SystemExit) as exc:
        bench_data.main([*studies, "--out", str(tmp_path / "s.json")])
    assert exc.value.code == 2 and "one study at a time" in capsys.readouterr().err
