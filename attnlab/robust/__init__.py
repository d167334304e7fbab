"""Adversarial suffixes: the GCG attack on our engine (`gcg`), the defenses (`defenses`), the attention view
(`attention_share`), the shipped benign pairs and ordinary prompts (`pairs`), the measurements (`evaluate`)."""
