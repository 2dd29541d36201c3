"""`distill train`: Lightning knowledge distillation of the draft on the target's logits."""
