"""Training: the target LM on the embedded corpus, and MTP drafter heads on the frozen target."""
