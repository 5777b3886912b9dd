"""Distillation: a student model trained to match a teacher on unlabeled data."""
