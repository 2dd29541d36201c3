"""Trimmed-vocabulary drafts (`distill/models/vocab.py`, `draft.vocab_size`): which tokens are kept, the reduced
tokenizer, the trimmed weights, the full-vocabulary view of them, and how train, eval and the vLLM worker treat
such a draft."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from distill.errors import InputError
from distill.models import vocab

REPO = Path(__file__).resolve().parents[1]


def test_select_vocab_keeps_always_then_frequent_then_lowest_ids():
    counts = Counter({40: 5, 30: 9, 20: 5, 99: 100})  # 99 is past the selectable ids
    assert vocab.select_vocab(counts, 4, 64, always=[7]) == [7, 20, 30, 40]  # 20 before 40: tie, lower id
    assert vocab.select_vocab(counts, 3, 64, always=[7]) == [7, 20, 30]
    # Fewer counted tokens than asked for: the lowest remaining ids fill up.
    assert vocab.select_vocab(counts, 7, 64, always=[7]) == [0, 1, 2, 7, 20, 30, 40]
    assert vocab.select_vocab(counts, 100, 8, always=[]) == list(range(8))  # capped at the vocabulary
    with pytest.raises(ValueError, match="must always be kept"):
        vocab.select_vocab(counts, 1, 64, always=[1, 2])


def test_renumber_config_ids_follows_the_kept_order():
    kept = [0, 2, 5, 9]
    out = vocab.renumber_config_ids(
        {"eos_token_id": [2, 9], "bos_token_id": 5, "pard_token": 9, "x": 9}, kept
    )
    assert out == {"eos_token_id": [1, 3], "bos_token_id": 2, "pard_token": 3, "x": 9}
    with pytest.raises(ValueError, match="pad_token_id"):
        vocab.renumber_config_ids({"pad_token_id": 4}, kept)


def _kept(tokenizer, size: int) -> list[int]:
    text = "the quick brown fox jumps over the lazy dog " * 3
    counts = vocab.count_tokens([tokenizer(text)["input_ids"]])
    return vocab.select_vocab(counts, size, len(tokenizer), vocab.always_kept(tokenizer, None))


def test_trimmed_tokenizer_holds_exactly_the_kept_tokens_and_still_encodes_any_text(
    tiny_target_dir, tmp_path
):
    from transformers import AutoTokenizer

    full = AutoTokenizer.from_pretrained(str(tiny_target_dir))
    kept = _kept(full, 300)
    shutil.copy(tiny_target_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    shutil.copy(tiny_target_dir / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    trimmed_json = vocab.trim_tokenizer_json(json.loads((tmp_path / "tokenizer.json").read_text()), kept)
    (tmp_path / "tokenizer.json").write_text(json.dumps(trimmed_json))
    small = AutoTokenizer.from_pretrained(str(tmp_path))

    by_id = {i: t for t, i in full.get_vocab().items()}
    assert small.get_vocab() == {by_id[old]: new for new, old in enumerate(kept)}
    assert vocab.check_subset_vocab(full.get_vocab(), small.get_vocab(), kept) == ""
    assert small.eos_token == full.eos_token and small.unk_token == full.unk_token
    # Text with tokens that were dropped still round-trips (down to the single-byte tokens).
    text = "Zebras quizzically vex jumping wolves: ÄÖÜ 42!"
    assert small.decode(small(text)["input_ids"]) == text
    # The counted text's own tokens were kept, and the reduced tokenizer still uses them.
    counted = full("the quick brown fox")["input_ids"]
    assert set(counted) <= set(kept)
    assert small("the quick brown fox")["input_ids"] == [kept.index(i) for i in counted]
    # A mismatch is named.
    wrong = list(kept)
    wrong[-1] = next(i for i in range(len(full)) if i not in kept)
    assert "is not the target's token" in vocab.check_subset_vocab(full.get_vocab(), small.get_vocab(), wrong)


def test_trim_model_selects_rows_and_the_wrapper_sees_the_target_vocabulary(tiny_llama):
    full = tiny_llama
    kept = [0, 3, 4, 10, 11, 12, 40, 63]
    ids = torch.tensor([[3, 10, 12, 40, 4]])
    with torch.no_grad():
        ref = full(input_ids=ids).logits
    import copy

    small = vocab.trim_model(copy.deepcopy(full), kept)
    assert small.config.vocab_size == len(kept)
    assert small.get_input_embeddings().weight.shape == (len(kept), 32)
    assert small.get_output_embeddings().weight.data_ptr() == small.get_input_embeddings().weight.data_ptr()
    small.config.pard_token = kept.index(40)  # saved folders renumber config ids (finish_trimmed_folder)
    view = vocab.trimmed_wrapper_class()(small, kept, 64, unk_id=0)
    assert view.config.pard_token == 40 and view.config.vocab_size == 64  # the target's terms
    with torch.no_grad():
        got = view(input_ids=ids).logits
        assert got.shape == ref.shape
        torch.testing.assert_close(got[..., kept], ref[..., kept])
        dropped = [i for i in range(64) if i not in kept]
        assert torch.isneginf(got[..., dropped]).all()
        # Decoder and head run apart (the parallel acceptance estimate) give the same logits.
        hidden = view.get_decoder()(input_ids=ids).last_hidden_state
        torch.testing.assert_close(view.get_output_embeddings()(hidden), got)
        # A target token the draft dropped reaches it as its unk token (draft id 0 = target id 0 here).
        torch.testing.assert_close(
            view(input_ids=torch.tensor([[5]])).logits, view(input_ids=torch.tensor([[0]])).logits
        )


def test_untied_head_is_trimmed_too(tiny_llama):
    tiny_llama.config.tie_word_embeddings = False
    head = torch.nn.Linear(32, 64, bias=False)
    head.weight.data.copy_(torch.randn(64, 32))
    tiny_llama.set_output_embeddings(head)
    kept = [1, 5, 7]
    small = vocab.trim_model(tiny_llama, kept)
    torch.testing.assert_close(small.get_output_embeddings().weight, head.weight[kept])


def _trimmed_folder(tiny_target_dir: Path, out: Path, size: int = 300) -> list[int]:
    from distill.models.draft import load_causal_lm, load_tokenizer, save_hf_folder

    tokenizer = load_tokenizer(tiny_target_dir)
    model = load_causal_lm(tiny_target_dir)
    kept = _kept(tokenizer, size)
    save_hf_folder(
        vocab.trim_model(model, kept), tokenizer, out, generation_source=tiny_target_dir, trimmed=(kept, 512)
    )
    return kept


def test_saved_trimmed_folder_is_marked_and_loads_as_the_target_vocabulary(tiny_target_dir, tmp_path):
    from distill.models.draft import load_causal_lm, load_tokenizer

    out = tmp_path / "draft"
    kept = _trimmed_folder(tiny_target_dir, out)
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 300 and config[vocab.TRIMMED_FROM_KEY] == 512
    assert vocab.read_kept_ids(out) == (kept, 512)
    assert vocab.read_kept_ids(tiny_target_dir) is None
    assert len(load_tokenizer(out)) == 300
    full, view = load_causal_lm(tiny_target_dir).eval(), load_causal_lm(out).eval()
    ids = torch.tensor([kept[20:30]])
    with torch.no_grad():
        torch.testing.assert_close(
            view(input_ids=ids).logits[..., kept], full(input_ids=ids).logits[..., kept]
        )


def test_vllm_maps_the_trimmed_tokenizer_onto_the_kept_ids(tiny_target_dir, tmp_path):
    mapping = pytest.importorskip("vllm.v1.spec_decode.vocab_mapping")
    from distill.models.draft import load_tokenizer

    out = tmp_path / "draft"
    kept = _trimmed_folder(tiny_target_dir, out)
    m = mapping.VocabMapping(load_tokenizer(tiny_target_dir), load_tokenizer(out), 512, 300, "cpu")
    assert m.intersection_size == 300
    assert m.draft_to_target_ids.tolist() == kept


def test_eval_accepts_a_trimmed_draft_and_runs_it_with_heterogeneous_vocab(tiny_target_dir, tmp_path):
    from distill.config import load_config
    from distill.evaluate.stage import build_job, preflight
    from distill.vllm_worker.speculate import speculative_config

    out = tmp_path / "draft"
    _trimmed_folder(tiny_target_dir, out)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"say {w}"}) + "\n" for w in ("a", "b", "c")))
    cfg = load_config(
        REPO / "configs/tiny.yaml",
        [
            f"target.model={tiny_target_dir}",
            f"run.dir={tmp_path / 'run'}",
            f"eval.prompts={prompts}",
            f"eval.drafts=[{{name: small, model: '{out}'}}]",
            "eval.temperatures=[0.0, 1.0]",
            "eval.draft_sample_methods=[greedy, probabilistic]",
            "eval.engine=hf",
        ],
    )
    plan = preflight(cfg)
    job = build_job(cfg, plan, None)
    drafted = [c for c in job["configs"] if c["name"] == "small"]
    assert drafted and all(c["heterogeneous_vocab"] for c in drafted)
    assert {c["draft_sample_method"] for c in drafted} == {"greedy"}  # vLLM drafts such a draft greedily only
    assert {c["temperature"] for c in drafted} == {0.0, 1.0}
    assert any("'small' has a trimmed vocabulary" in n and "not measured" in n for n in plan.notes)
    assert speculative_config(drafted[0], job)["use_heterogeneous_vocab"] is True
    full = dict(drafted[0], heterogeneous_vocab=False)
    assert "use_heterogeneous_vocab" not in speculative_config(full, job)

    # A trimmed draft whose tokens do not sit at its kept ids is refused before any engine starts.
    data = json.loads((out / vocab.KEPT_IDS_FILE).read_text())
    data["kept_ids"][5], data["kept_ids"][6] = data["kept_ids"][6], data["kept_ids"][5]
    (out / vocab.KEPT_IDS_FILE).write_text(json.dumps(data))
    with pytest.raises(
        InputError, match=r"eval\.drafts\[0\]\.model: trimmed draft .* is not the target's token"
    ):
        preflight(cfg)


def test_reference_engine_measures_a_trimmed_draft(tiny_target_dir, tmp_path):
    """The reference engine drafts through the full-vocabulary view: greedy output equals the target's."""
    from distill.evaluate.jobs import build_configs
    from distill.evaluate.reference import run_reference_job

    out = tmp_path / "draft"
    _trimmed_folder(tiny_target_dir, out)
    job = {
        "target": str(tiny_target_dir),
        "prompts": [[1, 50, 60, 70], [1, 80, 90]],
        "max_tokens": 8,
        "eos_token_id": 2,
        # The eval's own builder: the no_spec baseline and the trimmed draft, flagged as eval flags it.
        "configs": build_configs(
            drafts=[("small", str(out))],
            ks=[2],
            temperatures=[0.0],
            draft_sample_methods=["greedy"],
            ngram_k=None,
            trimmed={"small"},
        ),
        "repeats": 1,
        "seed": 0,
    }
    rows = {r["name"]: r for r in run_reference_job(job)["results"]}
    assert rows["small"]["token_ids"] == rows["no_spec"]["token_ids"]
    assert rows["small"]["num_draft_tokens"] > 0


def test_vocab_size_at_its_default_leaves_run_hashes_as_they_were():
    """draft.vocab_size came after run folders existed: at 0 it is not hashed, so those runs still match."""
    from distill import rundir
    from distill.config import config_hash, load_config, output_view

    cfg = load_config(REPO / "configs/smollm2-sharegpt.yaml", [])
    draft = output_view(cfg.draft)
    assert "vocab_size" not in draft and "parallel_tokens" in draft
    # The hash is the one computed before the key existed: the same sections without it.
    before = {k: v for k, v in output_view(cfg.draft).items() if k != "vocab_size"}
    sections = [
        before if s == "draft" else output_view(getattr(cfg, s)) for s in rundir.STAGE_INPUTS["train"]
    ]
    assert rundir.stage_hash(cfg, "train") == config_hash(cfg.run.seed, *sections)
    trimmed = load_config(REPO / "configs/smollm2-sharegpt.yaml", ["draft.vocab_size=8192"])
    assert output_view(trimmed.draft)["vocab_size"] == 8192
    assert rundir.stage_hash(trimmed, "train") != rundir.stage_hash(cfg, "train")
