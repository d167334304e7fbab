"""Evaluators: turn logits on real text into the numbers the papers report."""
