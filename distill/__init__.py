"""distill: knowledge-distil a draft model for speculative decoding and prove the gain inside vLLM."""

__version__ = "0.1.0"
