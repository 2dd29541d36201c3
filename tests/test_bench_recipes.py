"""bench/bench_recipes.py: recipe table from run folders (no training here)."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest

from bench import bench_recipes


def test_recipes_are_valid_config_overrides():
    from distill.config import load_config

    for name, overrides in bench_recipes.RECIPES.items():
        cfg = load_config(
            "configs/smollm2-sharegpt.yaml", [*bench_recipes.SHARED, *overrides]
        )  # raises if invalid
        assert any(o.startswith("draft.num_layers=") for o in overrides), name
        # autoregressive recipes stay autoregressive whatever the shipped config's drafting mode
        assert cfg.draft.parallel_tokens == (4 if name.startswith("pard4") else 0), name


def test_table_from_validation_history(tmp_path: Path):
    run = tmp_path / "r"
    (run / "train").mkdir(parents=True)
    hist = [{"step": 100, "top1_agreement": 0.25, "accept_len": {"1": 1.2}},
            {"step": 300, "top1_agreement": 0.35, "accept_len": {"1": 1.36, "2": 1.5}}]  # fmt: skip
    (run / "train" / "val_history.json").write_text(json.dumps(hist))
    assert bench_recipes.last_validation(run)["step"] == 300
    row = {"recipe": "ar2", "overrides": ["draft.num_layers=2"], "exit": 0, "step": 300, "wall_s": 120.0,
           "top1_by_step": {"100": 0.25, "300": 0.35}, "accept_len": hist[-1]["accept_len"]}  # fmt: skip
    md = bench_recipes.markdown([row], 300)
    assert (
        "| ar2 | `draft.num_layers=2` | 0 | 300 | 0.250 @100 → 0.350 @300 | 1.36 | 1.50 | — | — | 2.0 | — |"
        in md
    )


def test_recipes_run_one_at_a_time_make_one_table(tmp_path: Path):
    saved = tmp_path / "recipes.json"
    old = [{"recipe": "ar2-lr1e-3", "top1_agreement": 0.30}, {"recipe": "ar6-lr1e-3", "top1_agreement": 0.40}]
    saved.write_text(json.dumps({"steps": 300, "train_prompts": 6000, "rows": old}))
    fresh = [
        {"recipe": "ar2-lr1e-3", "top1_agreement": 0.35},
        {"recipe": "ar1-lr1e-3", "top1_agreement": 0.3},
    ]
    study = {"steps": 300, "train_prompts": 6000}
    merged = bench_recipes.merge_with_saved(saved, fresh, study)
    # A rerun recipe replaces its saved row; the others are kept; the order is the RECIPES order.
    assert [(r["recipe"], r["top1_agreement"]) for r in merged] == [
        ("ar2-lr1e-3", 0.35),
        ("ar1-lr1e-3", 0.3),
        ("ar6-lr1e-3", 0.40),
    ]
    # Another study (other steps or data size) is not mixed in.
    assert bench_recipes.merge_with_saved(saved, fresh, {**study, "steps": 600}) == fresh
    assert bench_recipes.merge_with_saved(saved, fresh, {"steps": 300, "data_run": "/runs/demo"}) == fresh
    assert bench_recipes.merge_with_saved(tmp_path / "none.json", fresh, study) == fresh


def fake_distill(calls: list[list[str]], check_train_data, returncode: int = 0):
    """A stand-in for `subprocess.run`: records each `distill` command; `distill data` makes the split folders,
    `distill train` calls `check_train_data(run_dir)` and (exit 0) writes a one-row validation history and the
    stage's completion record; with another `returncode` it writes nothing. Other commands (machine_info's git call) really run."""
    real_run = bench_recipes.subprocess.run

    def run(cmd, **kwargs):
        if "distill" not in cmd:
            return real_run(cmd, **kwargs)
        calls.append(cmd)
        run_dir = Path(next(a for a in cmd if a.startswith("run.dir=")).split("=", 1)[1])
        if cmd[3] == "data":
            for part in ("train", "val", "topk/train", "topk/val"):
                (run_dir / "data" / part).mkdir(parents=True, exist_ok=True)
        else:
            check_train_data(run_dir)
            if returncode == 0:  # a failed training here is one refused before its first step
                (run_dir / "train").mkdir(exist_ok=True)
                hist = [{"step": 300, "top1_agreement": 0.3, "accept_len": {"1": 1.3}}]
                (run_dir / "train" / "val_history.json").write_text(json.dumps(hist))
                write_train_record(run_dir)
        return type("Done", (), {"returncode": returncode})()

    return run


def write_train_record(run_dir: Path) -> None:
    """The train stage's completion record, as each successful `distill train` rewrites it."""
    (run_dir / "stages").mkdir(exist_ok=True)
    record = {"stage": "train", "finished": f"2026-12-06T08:00:00.{time.perf_counter_ns()}+00:00"}
    (run_dir / "stages" / "train.json").write_text(json.dumps(record))


def test_a_finished_runs_data_is_trained_on_in_place(tmp_path: Path, monkeypatch):
    """--data-run: every recipe's run folder links that run's data; nothing is generated; its own table."""
    demo = tmp_path / "demo"
    (demo / "data").mkdir(parents=True)
    (demo / "data" / "manifest.json").write_text("{}")
    calls: list[list[str]] = []

    def check_train_data(run_dir: Path) -> None:
        assert (run_dir / "data").resolve() == (demo / "data").resolve()

    monkeypatch.setattr(bench_recipes, "ensure_data", lambda *a: pytest.fail("no data run may be built"))
    monkeypatch.setattr(bench_recipes.subprocess, "run", fake_distill(calls, check_train_data))
    out = tmp_path / "out"
    args = ["--recipes", "pard4-layers-first-last", "--data-run", str(demo), "--out-dir", str(out)]
    assert bench_recipes.main(args) == 0
    assert calls and "draft.layers=[0,-1]" in calls[0]
    saved = json.loads((out / "recipes-demo.json").read_text())
    assert saved["data_run"] == str(demo.resolve()) and saved["rows"][0]["top1_agreement"] == 0.3
    assert f"the data of the run `{demo}`" in (out / "recipes-demo.md").read_text()
    # --table-only trains nothing and re-reads the rows from their run folders.
    calls.clear()
    hist = [{"step": 300, "top1_agreement": 0.2, "per_position": {"0": {"top1_agreement": 0.35}}}]
    run_dir = out / "work" / "recipes-demo" / "pard4-layers-first-last"
    (run_dir / "train" / "val_history.json").write_text(json.dumps(hist))
    assert bench_recipes.main([*args, "--table-only"]) == 0
    assert not calls
    assert json.loads((out / "recipes-demo.json").read_text())["rows"][0]["top1_agreement"] == 0.35
    with pytest.raises(SystemExit):
        bench_recipes.main(["--data-run", str(tmp_path / "nothing"), "--out-dir", str(out)])


def test_a_parallel_drafts_top1_is_its_first_drafted_tokens():
    parallel = {
        "top1_agreement": 0.17,
        "per_position": {"0": {"top1_agreement": 0.32}, "1": {"top1_agreement": 0.16}},
    }
    assert bench_recipes.first_token_top1(parallel) == 0.32
    assert bench_recipes.first_token_top1({"top1_agreement": 0.35}) == 0.35


def test_rows_are_read_from_their_run_folders(tmp_path: Path):
    run = tmp_path / "pard4-lr2e-3"
    (run / "train").mkdir(parents=True)
    hist = [
        {
            "step": 300,
            "top1_agreement": 0.19,
            "accept_len": {"1": 1.34},
            "per_position": {"0": {"top1_agreement": 0.345}},
        }
    ]
    (run / "train" / "val_history.json").write_text(json.dumps(hist))
    saved = {
        "recipe": "pard4-lr2e-3",
        "exit": 0,
        "wall_s": 1170.0,
        "top1_agreement": 0.19,
        "top1_by_step": {"300": 0.19},
    }
    row = bench_recipes.with_validation(saved, run)
    assert (
        row["top1_agreement"] == 0.345 and row["top1_by_step"] == {"300": 0.345} and row["wall_s"] == 1170.0
    )
    failed = bench_recipes.with_validation({"recipe": "x", "wall_s": 3.0, "exit": 1}, tmp_path / "none")
    assert failed["step"] is None and failed["accept_len"] is None
    assert "| x |" in bench_recipes.markdown([{**failed, "overrides": []}], 300)


def test_data_variant_overrides_are_valid_and_name_a_recipe():
    from distill.config import load_config

    for name, overrides in bench_recipes.DATA_VARIANTS.items():
        assert name in bench_recipes.RECIPES, name
        assert load_config("configs/smollm2-sharegpt.yaml", overrides)  # raises if invalid


def test_a_data_variant_trains_on_its_own_responses_and_validates_on_the_shared_rows(
    tmp_path: Path, monkeypatch
):
    """The variant's data run is built from the shared run's resolved config plus its overrides; the recipe's
    data folder takes the train split (and its cache) from it and the val split (and its cache) from the shared
    run, so the row is measured on the same validation rows as every other."""
    demo = tmp_path / "demo"
    for part in ("train", "val", "topk/train", "topk/val"):
        (demo / "data" / part).mkdir(parents=True)
    (demo / "data" / "manifest.json").write_text("{}")
    (demo / "config.yaml").write_text("run: {}\n")
    calls: list[list[str]] = []

    def check_train_data(run_dir: Path) -> None:
        data = run_dir / "data"
        variant = (run_dir.parent / f"data-{run_dir.name}" / "data").resolve()
        assert (data / "train").resolve() == variant / "train"
        assert (data / "topk" / "train").resolve() == variant / "topk" / "train"
        assert (data / "val").resolve() == (demo / "data" / "val").resolve()
        assert (data / "topk" / "val").resolve() == (demo / "data" / "topk" / "val").resolve()

    monkeypatch.setattr(bench_recipes.subprocess, "run", fake_distill(calls, check_train_data))
    out = tmp_path / "out"
    args = ["--recipes", "pard4-lr4e-3-data-t1", "--data-run", str(demo), "--out-dir", str(out)]
    assert bench_recipes.main(args) == 0
    data_call, train_call = calls
    assert data_call[3:5] == ["data", "-c"] and data_call[5] == str(demo.resolve() / "config.yaml")
    assert "data.temperature=1.0" in data_call and "data.temperature=1.0" not in train_call
    assert "train.lr=4e-3" in train_call
    md = (out / "recipes-demo.md").read_text()
    assert "training responses: `data.temperature=1.0`" in md
    # A rerun links nothing twice.
    calls.clear()
    (out / "work" / "recipes-demo" / "pard4-lr4e-3-data-t1" / "train").rename(tmp_path / "old-train")
    assert bench_recipes.main(args) == 0


def test_a_recipe_folder_with_data_of_its_own_is_refused(tmp_path: Path, monkeypatch, capsys):
    """A run folder whose `data` is not the study's (another command generated data there) would train the row
    on other data than it names: refused with exit 2 before any training."""
    demo = tmp_path / "demo"
    (demo / "data" / "val").mkdir(parents=True)
    (demo / "data" / "manifest.json").write_text("{}")
    out = tmp_path / "out"
    own = out / "work" / "recipes-demo" / "pard4-lr4e-3" / "data"
    own.mkdir(parents=True)
    monkeypatch.setattr(bench_recipes.subprocess, "run", lambda *a, **k: pytest.fail("nothing may run"))
    args = ["--recipes", "pard4-lr4e-3", "--data-run", str(demo), "--out-dir", str(out)]
    with pytest.raises(SystemExit) as exit_info:
        bench_recipes.main(args)
    assert exit_info.value.code == 2
    assert f"{own} is not a link to {demo.resolve() / 'data'}" in capsys.readouterr().err
    # The same for a data-variant recipe whose folder links the shared data run as a whole.
    variant = out / "work" / "recipes-demo" / "pard4-lr4e-3-data-t1"
    variant.mkdir()
    (variant / "data").symlink_to(demo / "data", target_is_directory=True)
    monkeypatch.setattr(bench_recipes, "ensure_variant_data", lambda *a: None)
    with pytest.raises(SystemExit):
        bench_recipes.main(["--recipes", "pard4-lr4e-3-data-t1", *args[2:]])
    assert "this recipe mixes two" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# What a row may claim: its own training, from step 0, in its own study


def demo_run(tmp_path: Path) -> Path:
    """A finished run's data folder for --data-run (the fake `distill` reads nothing from it)."""
    demo = tmp_path / "demo"
    (demo / "data").mkdir(parents=True)
    (demo / "data" / "manifest.json").write_text("{}")
    return demo


def no_check(run_dir: Path) -> None:
    pass


def test_a_failed_training_shows_its_exit_and_no_figures(tmp_path: Path, monkeypatch):
    """A recipe trained once, then refused (exit 2) by a later invocation: its folder still holds the first
    training's history, which must not appear as this invocation's result (no figures, no wall time)."""
    demo, out = demo_run(tmp_path), tmp_path / "out"
    args = ["--recipes", "pard4-lr4e-3", "--data-run", str(demo), "--out-dir", str(out)]
    monkeypatch.setattr(bench_recipes.subprocess, "run", fake_distill([], no_check))
    assert bench_recipes.main(args) == 0
    monkeypatch.setattr(bench_recipes.subprocess, "run", fake_distill([], no_check, returncode=2))
    assert bench_recipes.main(args) == 1
    (row,) = json.loads((out / "recipes-demo.json").read_text())["rows"]
    assert row["exit"] == 2 and row["top1_agreement"] is None and row["accept_len"] is None
    line = next(x for x in (out / "recipes-demo.md").read_text().splitlines() if x.startswith("| pard4"))
    assert line.split(" | ")[2:10] == [
        "2",
        "—",
        "—",
        "—",
        "—",
        "—",
        "—",
        "—",
    ]  # exit, step, top-1, E[k], wall


def test_every_recipe_trains_from_step_0(tmp_path: Path, monkeypatch):
    """The recipe's folder persists between invocations: resuming its finished checkpoint would train 0 steps
    and report the earlier training's figures with a minute of wall time."""
    from distill.config import load_config

    calls: list[list[str]] = []
    monkeypatch.setattr(bench_recipes.subprocess, "run", fake_distill(calls, no_check))
    out = tmp_path / "out"
    args = ["--recipes", "ar2-lr1e-3", "--data-run", str(demo_run(tmp_path)), "--out-dir", str(out)]
    assert bench_recipes.main(args) == 0
    assert "train.resume=never" in calls[-1]
    assert "from step 0 (`train.resume=never`)" in (out / "recipes-demo.md").read_text()
    cfg = load_config("configs/smollm2-sharegpt.yaml", [bench_recipes.FRESH_START, *bench_recipes.SHARED])
    assert cfg.train.resume == "never"


def test_a_run_folder_trained_again_is_not_read_as_the_saved_row(tmp_path: Path, monkeypatch):
    """--table-only re-reads each saved row from its run folder; a folder another invocation trained since (a
    completion record of another time) holds that training's figures, not the row's."""
    monkeypatch.setattr(bench_recipes.subprocess, "run", fake_distill([], no_check))
    out = tmp_path / "out"
    args = ["--recipes", "pard4-lr2e-3", "--data-run", str(demo_run(tmp_path)), "--out-dir", str(out)]
    assert bench_recipes.main(args) == 0
    run_dir = out / "work" / "recipes-demo" / "pard4-lr2e-3"
    (run_dir / "train" / "val_history.json").write_text(json.dumps([{"step": 20, "top1_agreement": 0.1}]))
    write_train_record(run_dir)
    assert bench_recipes.main([*args, "--table-only"]) == 0
    (row,) = json.loads((out / "recipes-demo.json").read_text())["rows"]
    assert row["top1_agreement"] is None and row["step"] is None
    assert bench_recipes.RETRAINED in (out / "recipes-demo.md").read_text()


def test_saved_rows_of_another_config_are_not_merged(tmp_path: Path, monkeypatch):
    """Same steps and data but another config file, or the same file edited: another study."""
    monkeypatch.setattr(bench_recipes.subprocess, "run", fake_distill([], no_check))
    demo, out = demo_run(tmp_path), tmp_path / "out"
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("run: {}\n")
    b.write_text("run: {}\n# b\n")

    def recipes_after(config: Path, recipe: str) -> list[str]:
        args = ["-c", str(config), "--recipes", recipe, "--data-run", str(demo), "--out-dir", str(out)]
        assert bench_recipes.main(args) == 0
        return [r["recipe"] for r in json.loads((out / "recipes-demo.json").read_text())["rows"]]

    assert recipes_after(a, "pard4-lr2e-3") == ["pard4-lr2e-3"]
    assert recipes_after(b, "pard4-lr4e-3") == ["pard4-lr4e-3"]
    assert recipes_after(b, "pard4-lr8e-3") == ["pard4-lr4e-3", "pard4-lr8e-3"]  # the same study merges
    b.write_text("run: {}\n# b, edited\n")
    assert recipes_after(b, "pard4-lr2e-3") == ["pard4-lr2e-3"]
    saved = json.loads((out / "recipes-demo.json").read_text())
    assert saved["config"] == str(b) and saved["config_sha256"] == hashlib.sha256(b.read_bytes()).hexdigest()


def test_each_row_names_the_invocation_that_trained_it(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(bench_recipes.subprocess, "run", fake_distill([], no_check))
    out = tmp_path / "out"
    common = ["--data-run", str(demo_run(tmp_path)), "--out-dir", str(out)]
    for recipe in ("pard4-lr2e-3", "pard4-lr4e-3"):
        assert bench_recipes.main(["--recipes", recipe, *common]) == 0
    rows = json.loads((out / "recipes-demo.json").read_text())["rows"]
    for row in rows:
        assert f"--recipes {row['recipe']}" in row["command"] and row["machine"]["git"] == common_git()
    md = (out / "recipes-demo.md").read_text()
    for row in rows:
        assert f"- {row['recipe']}: `{row['command']}`; " in md


def common_git() -> str | None:
    from bench.common import git_sha

    return git_sha()


def test_quick_mode_keeps_the_studys_table(tmp_path: Path, monkeypatch):
    """`--quick` (make bench --quick) has its own table: its 20-step row must not replace the study's rows,
    which --table-only could not rebuild."""

    def ensure_data(config: str, data_dir: Path, train_prompts: int) -> None:
        (data_dir / "data").mkdir(parents=True, exist_ok=True)

    monkeypatch.setattr(bench_recipes, "ensure_data", ensure_data)
    monkeypatch.setattr(bench_recipes.subprocess, "run", fake_distill([], no_check))
    out = tmp_path / "out"
    assert bench_recipes.main(["--recipes", "ar6-lr1e-3", "--out-dir", str(out)]) == 0
    assert bench_recipes.main(["--quick", "--out-dir", str(out)]) == 0
    study = json.loads((out / "recipes.json").read_text())
    assert study["steps"] == 300 and [r["recipe"] for r in study["rows"]] == ["ar6-lr1e-3"]
    quick = json.loads((out / "recipes-quick.json").read_text())
    assert quick["steps"] == 20 and [r["recipe"] for r in quick["rows"]] == ["ar2-lr1e-3"]


def test_table_only_without_rows_of_the_study_is_refused(tmp_path: Path, monkeypatch, capsys):
    """An empty table written over the saved one would look like a result: exit 2 naming the options."""
    monkeypatch.setattr(bench_recipes.subprocess, "run", fake_distill([], no_check))
    out = tmp_path / "out"
    args = ["--recipes", "pard4-lr4e-3", "--data-run", str(demo_run(tmp_path)), "--out-dir", str(out)]
    with pytest.raises(SystemExit) as exit_info:
        bench_recipes.main([*args, "--table-only"])
    assert exit_info.value.code == 2 and "no saved table" in capsys.readouterr().err
    assert bench_recipes.main(args) == 0
    before = (out / "recipes-demo.md").read_text()
    with pytest.raises(SystemExit) as exit_info:
        bench_recipes.main([*args, "--table-only", "--steps", "600"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "steps=600" in err and "steps=300" in err and "--steps" in err
    assert (out / "recipes-demo.md").read_text() == before


def test_a_study_under_other_steps_keeps_the_saved_table_beside_its_own(tmp_path: Path, monkeypatch, capsys):
    """Another study's table is set aside under its config hash and steps, not overwritten."""
    monkeypatch.setattr(bench_recipes.subprocess, "run", fake_distill([], no_check))
    out = tmp_path / "out"
    args = ["--recipes", "pard4-lr4e-3", "--data-run", str(demo_run(tmp_path)), "--out-dir", str(out)]
    assert bench_recipes.main(args) == 0
    first = json.loads((out / "recipes-demo.json").read_text())
    first_md = (out / "recipes-demo.md").read_text()
    assert bench_recipes.main([*args, "--steps", "600"]) == 0
    assert json.loads((out / "recipes-demo.json").read_text())["steps"] == 600
    tag = f"{first['config_sha256'][:12]}-300steps"
    assert json.loads((out / f"recipes-demo.{tag}.json").read_text()) == first
    assert (out / f"recipes-demo.{tag}.md").read_text() == first_md
    assert f"kept as {out / f'recipes-demo.{tag}.json'}" in capsys.readouterr().err
    # the same study again merges into its table and sets nothing aside
    assert bench_recipes.main([*args, "--steps", "600"]) == 0
    assert sorted(p.name for p in out.glob("recipes-demo*.json")) == [
        f"recipes-demo.{tag}.json",
        "recipes-demo.json",
    ]


@pytest.mark.parametrize("option", [["--steps", "0"], ["--train-prompts", "-5"], ["--steps", "3x"]])
def test_counts_must_be_positive_whole_numbers(option: list[str]):
    with pytest.raises(SystemExit) as exit_info:
        bench_recipes.main([*option, "--list"])
    assert exit_info.value.code == 2
