"""`distill data`: prompts -> target-generated distillation records (+ optional top-k teacher logits)."""
