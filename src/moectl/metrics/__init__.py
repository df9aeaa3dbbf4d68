"""Metrics read from routing traces: switch rate (TE-MoE §2.2)."""
