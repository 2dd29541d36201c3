"""The model card's serving setting: the published draft's own measured row, served as eval measured it."""

from __future__ import annotations

from typing import Any

from distill.publish import card

OURS, OTHER = "/runs/x/draft", "/models/other"


def _row(name: str, draft: str, k: int, speedup: float, **extra: Any) -> dict[str, Any]:
    row = {"name": name, "method": "draft_model", "draft": draft, "k": k, "temperature": 0.0}
    return row | {"draft_sample_method": "greedy", "speedup": speedup, "acceptance_rate": 0.5, **extra}


def _rec(row: dict[str, Any]) -> dict[str, Any]:
    keys = ("name", "draft", "k", "temperature", "draft_sample_method", "speedup")
    return {key: row[key] for key in keys} | {"deploy": True}


def test_recommendation_is_served_only_when_it_names_the_published_draft():
    ours = [_row("mine", OURS, 1, 1.1), _row("mine", OURS, 2, 1.05)]
    elsewhere = _rec(_row("other", OTHER, 3, 1.4))
    assert card.best_setting(ours, {"recommendation": elsewhere}) == (ours[0], False)
    assert card.best_setting(ours, {"recommendation": _rec(ours[1])}) == (ours[1], True)
    # same label and k, but measured with another draft sampling: not the recommended row
    probabilistic = _rec(ours[1]) | {"draft_sample_method": "probabilistic"}
    assert card.best_setting(ours, {"recommendation": probabilistic}) == (ours[0], False)
    # older reports' recommendations carry no draft / draft_sample_method: label, k and temperature decide
    old = {"name": "mine", "k": 2, "temperature": 0.0}
    assert card.best_setting(ours, {"recommendation": old}) == (ours[1], True)


def test_fastest_row_skips_settings_that_changed_the_greedy_output():
    broken = _row("d", OURS, 4, 2.0, dtype="float32", greedy_match=0.5)
    fine = _row("d", OURS, 2, 1.2, dtype="float32", greedy_match=1.0)
    assert card.fastest_row([broken, fine]) is fine
    assert card.fastest_row([broken]) is broken  # nothing else: served, and the gate refuses it
    untimed = _row("d", OURS, 2, 0.0) | {"speedup": None}
    assert card.fastest_row([untimed]) is untimed and card.fastest_row([]) is None


def test_speculative_config_is_the_rows_own_with_the_release_as_model():
    hot = _row("d", OURS, 3, 1.5, temperature=1.0, draft_sample_method="probabilistic")
    report: dict[str, Any] = {"settings": {"rejection_sample_method": "standard"}}
    assert card.speculative_config("rel/1", hot, report) == {
        "method": "draft_model",
        "num_speculative_tokens": 3,
        "model": "rel/1",
        "draft_sample_method": "probabilistic",
    }
    report["settings"]["rejection_sample_method"] = "block"
    assert card.speculative_config("rel/1", hot, report)["rejection_sample_method"] == "block"
    rec = _rec(hot) | {"speculative_config": {"method": "draft_model", "model": OURS, "x": 1}}
    served = card.speculative_config("rel/1", hot, {"recommendation": rec}, from_rec=True)
    # A recommended config without k (an older report) takes the row's: render() reads it.
    assert served == {"method": "draft_model", "model": "rel/1", "x": 1, "num_speculative_tokens": 3}
    assert rec["speculative_config"]["model"] == OURS  # the report is not modified
    assert "num_speculative_tokens" not in rec["speculative_config"]


def _render(rows: list[dict[str, Any]], report: dict[str, Any]) -> str:
    target = card.TargetInfo("t", None, None, "unknown", "/models/t")
    inputs = card.CardInputs("d", "1", "/rel/d/1", target, report, [], draft_rows=rows)
    return card.render(inputs)


def test_card_without_rows_for_the_draft_never_serves_another_drafts_setting():
    other = _row("other", OTHER, 3, 1.4)
    readme = _render([], {"results": [other], "recommendation": _rec(other)})
    assert '"num_speculative_tokens": 3' not in readme
    assert f'"num_speculative_tokens": {card.UNMEASURED_K}' in readme
    assert "This draft has no measured setting in the eval report" in readme
    assert "Eval's recommendation is for another draft measured beside this one: other" in readme


def test_card_states_the_temperature_of_the_served_setting():
    hot = _row("d", OURS, 2, 1.3, temperature=1.0, draft_sample_method="probabilistic")
    readme = _render([hot], {"results": [hot], "recommendation": _rec(hot)})
    assert "Setting: eval's recommendation, measured at **temperature 1.00**" in readme
    assert '"draft_sample_method": "probabilistic"' in readme
    assert "Eval's recommendation: deploy — d at k=2, temperature 1.00" in readme


def test_trimmed_draft_is_served_with_heterogeneous_vocab_and_explained(tmp_path):
    from distill.models.vocab import KEPT_IDS_FILE

    measured = _row("d", OURS, 3, 1.3, heterogeneous_vocab=True)
    spec = card.speculative_config("rel/1", measured, {})
    assert spec["use_heterogeneous_vocab"] is True and spec["draft_sample_method"] == "greedy"
    readme = _render([measured], {"results": [measured], "recommendation": _rec(measured)})
    assert '"use_heterogeneous_vocab": true' in readme and "## Trimmed vocabulary" in readme
    # A report row from before the key: the draft folder's own distill_vocab.json says so.
    (tmp_path / KEPT_IDS_FILE).write_text("{}")
    old = _row("d", str(tmp_path), 3, 1.3)
    assert card.speculative_config("rel/1", old, {})["use_heterogeneous_vocab"] is True
    plain = card.speculative_config("rel/1", _row("d", OURS, 3, 1.3), {})
    assert "use_heterogeneous_vocab" not in plain
    assert "## Trimmed vocabulary" not in _render([_row("d", OURS, 3, 1.3)], {})
