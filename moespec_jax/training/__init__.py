"""Training: the target LM on the embedded corpus (and, later, MTP drafter heads)."""
