"""Config schema, loader and CLI error handling (exit codes, did-you-mean, nothing written)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from distill.cli import main
from distill.config import Config, docs_markdown, iter_docs, load_config, to_yaml
from distill.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted((REPO / "configs").glob("*.yaml"))


def test_there_are_shipped_configs():
    names = {p.name for p in SHIPPED}
    assert {"smollm2-sharegpt.yaml", "tiny.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert cfg.run.dir == f"checkpoints/{cfg.run.name}"
    # defaults that reference the run folder are resolved
    assert all("${" not in d.model for d in cfg.eval.drafts)


def test_overrides_are_typed_and_applied():
    cfg = load_config(
        REPO / "configs/tiny.yaml",
        [
            "train.max_steps=7",
            "eval.k=[1,2,4]",
            "run.dir=/tmp/x",
            "'eval.drafts=[{name: a, model: models/a}]'".strip("'"),
        ],
    )
    assert cfg.train.max_steps == 7
    assert cfg.eval.k == [1, 2, 4]
    assert cfg.eval.drafts[0].name == "a" and cfg.eval.drafts[0].model == "models/a"


def test_default_drafts_follow_run_dir():
    cfg = load_config(REPO / "configs/tiny.yaml", ["run.dir=/tmp/somewhere"])
    assert [(d.name, d.model) for d in cfg.eval.drafts] == [
        ("base", "/tmp/somewhere/draft_init"),
        ("distilled", "/tmp/somewhere/draft"),
    ]


def test_unknown_key_gets_did_you_mean():
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "configs/smollm2-sharegpt.yaml", ["train.max_stpes=3"])
    assert "train.max_stpes" in str(e.value) and "Did you mean 'max_steps'" in str(e.value)


def test_unknown_section_and_all_problems_reported_together():
    with pytest.raises(ConfigError) as e:
        load_config(
            None,
            ["trian.lr=1", "data.temperature=hot", "draft.init=magic", "eval.k=[0,2]", "train.max_steps=0"],
        )
    problems = e.value.problems
    joined = "\n".join(problems)
    assert "Did you mean 'train'" in joined
    assert "data.temperature" in joined and "expected a number" in joined
    assert "draft.init" in joined and "'truncate'" in joined
    # type errors stop before range checks; the range problems show once types are right
    with pytest.raises(ConfigError) as e2:
        load_config(None, ["eval.k=[0,2]", "train.max_steps=0", "data.top_p=1.5"])
    joined = "\n".join(e2.value.problems)
    assert len(e2.value.problems) == 3
    assert "eval.k" in joined and "train.max_steps" in joined and "data.top_p" in joined


def test_cross_field_checks():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["draft.init=pretrained"])
    assert "draft.model" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["draft.init=config", "draft.num_attention_heads=4", "draft.num_key_value_heads=3"])
    assert "num_key_value_heads" in str(e.value)


def test_bad_yaml_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError.__mro__[1]) as e:  # InputError
        load_config(bad)
    assert str(bad) in str(e.value)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("eval.k=[1", "override 'eval.k=[1': the value is not valid YAML"),
        ("data.max_new_tokens=${run.name}", "data.max_new_tokens: While dereferencing interpolation"),
        ("data.source=${oops}", "data.source: Interpolation key 'oops' not found"),
    ],
)
def test_bad_override_values_are_exit_2_naming_the_override(override, needle, capsys):
    assert main(["validate", "-c", str(REPO / "configs/tiny.yaml"), override]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert "full_key" not in err and "object_type" not in err  # OmegaConf's internals stay out


def test_validate_prints_resolved_yaml_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = main(["validate", "-c", str(REPO / "configs/smollm2-sharegpt.yaml"), "train.max_steps=3"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "max_steps: 3" in out and "model: smollm2-135m-instruct" in out
    assert "dir: checkpoints/smollm2-sharegpt" in out
    assert list(tmp_path.iterdir()) == []


def test_cli_bad_config_exits_2_without_traceback(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = main(["validate", "-c", str(REPO / "configs/smollm2-sharegpt.yaml"), "train.max_stpes=3"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "Did you mean 'max_steps'" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
    assert main(["train", "-c", str(tmp_path / "missing.yaml")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["validate", "-c", str(REPO / "configs/tiny.yaml"), "no_equals_sign"]) == 2


def test_python_dash_m_entry_point():
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "distill",
            "validate",
            "-c",
            str(REPO / "configs/tiny.yaml"),
            "train.max_stpes=1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "Did you mean 'max_steps'" in out.stderr and "Traceback" not in out.stderr


def test_every_key_is_documented():
    for key, tp, _default, help_ in iter_docs():
        assert help_.strip(), f"{key} has no help text in the schema"
        assert tp


def test_keys_of_list_entries_are_documented():
    """eval.drafts entries have keys of their own (name, model, k, method): each has its row."""
    keys = {key for key, *_ in iter_docs()}
    assert {f"eval.drafts[].{k}" for k in ("name", "model", "k", "method")} <= keys
    assert "`eval.drafts[].method` | one of 'draft_model', 'eagle'" in docs_markdown("eval")


def test_docs_command(capsys):
    assert main(["docs", "train"]) == 0
    out = capsys.readouterr().out
    assert "`train.max_steps`" in out and "`data.source`" not in out
    assert main(["docs", "nosuch"]) == 2


def test_readme_config_reference_is_in_sync():
    readme = (REPO / "README.md").read_text()
    m = re.search(r"<!-- config-reference:start -->\n(.*?)<!-- config-reference:end -->", readme, re.S)
    assert m, "README.md lacks the generated config reference block"
    assert m.group(1).strip() == docs_markdown().strip(), (
        "README config reference is stale: run `make docs` (python -m distill.tools.readme_docs)"
    )


def test_to_yaml_round_trip(tmp_path):
    cfg = load_config(REPO / "configs/tiny.yaml", ["train.max_steps=5"])
    p = tmp_path / "resolved.yaml"
    p.write_text(to_yaml(cfg))
    again = load_config(p)
    assert to_yaml(again) == to_yaml(cfg)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["draft.layers=[0,1,2]"], "set draft.num_layers=3"),
        (["draft.init=config", "draft.layers=[0,1]"], "only `draft.init: truncate`"),
    ],
)
def test_draft_layers_must_fit_num_layers_and_truncate(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)
    assert load_config(None, ["draft.layers=[0,1,-1]", "draft.num_layers=3"]).draft.layers == [0, 1, -1]


def test_list_types_read_in_the_plural():
    from distill.config import DraftConfig, _hints, describe_type

    assert describe_type(_hints(DraftConfig)["layers"]) == "a list of integers or null"
