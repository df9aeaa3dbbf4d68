"""Pretraining moectl's own MoEs: standard and EMO objectives (EMO §3)."""
