"""`distill eval`: measure drafts inside vLLM speculative decoding (and a reference PyTorch engine)."""
