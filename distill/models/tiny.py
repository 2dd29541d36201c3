"""Tiny Llama models and a tiny byte-level BPE tokenizer, built in code (tests, `configs/tiny.yaml`).

Nothing is downloaded: the tokenizer is trained on a fixed synthetic corpus, the weights come from a seeded
init. The target gets a larger init scale so its next-token distributions are peaked like a real LM's
(a near-uniform teacher would make acceptance meaningless).
"""

from __future__ import annotations

import random
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "and",
    "in",
    "is",
    "it",
    "that",
    "for",
    "on",
    "with",
    "as",
    "was",
    "be",
    "by",
    "this",
    "are",
    "from",
    "at",
    "or",
    "have",
    "not",
    "but",
    "what",
    "all",
    "were",
    "when",
    "we",
    "there",
    "can",
    "your",
    "which",
    "their",
    "said",
    "if",
    "will",
    "each",
    "about",
    "how",
    "up",
    "out",
    "them",
    "then",
    "she",
    "many",
    "some",
    "so",
    "these",
    "would",
    "other",
    "into",
    "has",
    "more",
    "her",
    "two",
    "like",
    "him",
    "see",
    "time",
    "could",
    "no",
    "make",
    "than",
    "first",
    "been",
    "its",
    "who",
    "now",
    "people",
    "my",
    "made",
    "over",
    "did",
    "down",
    "only",
    "way",
    "find",
    "use",
    "may",
    "water",
    "long",
    "little",
    "very",
    "after",
    "words",
    "called",
    "just",
    "where",
    "most",
    "know",
    "get",
    "through",
    "back",
    "much",
    "before",
    "go",
    "good",
    "new",
    "write",
    "our",
    "used",
    "me",
    "man",
    "too",
    "any",
    "day",
    "same",
    "right",
    "look",
    "think",
    "also",
    "around",
    "another",
    "came",
    "come",
    "work",
    "three",
    "word",
    "must",
    "because",
    "does",
    "part",
    "even",
    "place",
    "well",
    "such",
    "here",
    "take",
    "why",
    "things",
    "help",
    "put",
    "years",
    "different",
    "away",
    "again",
    "off",
    "went",
    "old",
    "number",
    "great",
    "tell",
    "men",
    "say",
    "small",
    "every",
    "found",
    "still",
    "between",
    "name",
    "should",
    "home",
    "big",
    "give",
    "air",
    "line",
    "set",
    "own",
    "under",
    "read",
    "last",
    "never",
    "us",
    "left",
    "end",
    "along",
    "while",
    "might",
    "next",
    "sound",
    "below",
    "saw",
    "something",
    "thought",
    "both",
    "few",
    "those",
    "always",
    "looked",
    "show",
    "large",
    "often",
    "together",
    "asked",
    "house",
    "world",
    "going",
    "want",
    "school",
    "important",
    "until",
    "form",
    "food",
    "keep",
    "children",
    "feet",
    "land",
    "side",
    "without",
    "boy",
    "once",
    "animals",
    "life",
    "enough",
    "took",
    "sometimes",
    "four",
    "head",
    "above",
    "kind",
    "began",
    "almost",
    "live",
    "page",
    "got",
    "model",
    "draft",
    "token",
    "speculative",
    "decoding",
    "target",
    "accept",
    "reject",
    "sample",
    "probability",
    "distribution",
    "python",
    "code",
    "function",
    "data",
    "train",
    "loss",
    "value",
    "list",
    "print",
    "return",
    "class",
    "import",
    "error",
    "file",
    "write",
    "explain",
    "summarize",
]


def synthetic_corpus(n_sentences: int = 3000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n_sentences):
        n = rng.randint(4, 16)
        words = [rng.choice(_WORDS) for _ in range(n)]
        sentence = " ".join(words).capitalize() + rng.choice([".", "?", "!", ":", ","])
        if rng.random() < 0.1:
            sentence += f" {rng.randint(0, 999)}"
        out.append(sentence)
    return out


def build_tiny_tokenizer(vocab_size: int = 512, seed: int = 0):  # -> PreTrainedTokenizerFast
    """A byte-level BPE tokenizer (any text encodes) with ChatML special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(seed=seed), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        model_max_length=2048,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_llama_config(
    vocab_size: int,
    *,
    num_layers: int = 4,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    init_scale: float = 0.02,
    tie_word_embeddings: bool = False,
):  # -> LlamaConfig
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        initializer_range=init_scale,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=SPECIAL_TOKENS.index("<|im_start|>"),
        eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
        pad_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
    )


def build_tiny_llama(tokenizer, *, seed: int = 0, init_scale: float = 0.2, **sizes):  # -> LlamaForCausalLM
    """A seeded random tiny Llama on `tokenizer`. `init_scale` 0.2 gives peaked next-token distributions."""
    import torch
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(len(tokenizer), init_scale=init_scale, **sizes)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.eval()
    return model


def save_tiny_model(
    out_dir: str | Path, *, seed: int = 0, init_scale: float = 0.2, tokenizer=None, **sizes
) -> Path:
    """Build and save a tiny Llama + tokenizer + generation config as an HF folder (safetensors)."""
    from transformers import GenerationConfig

    out = Path(out_dir)
    tokenizer = tokenizer or build_tiny_tokenizer()
    model = build_tiny_llama(tokenizer, seed=seed, init_scale=init_scale, **sizes)
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
