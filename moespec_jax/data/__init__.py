"""The embedded corpus, tokenizers and training/validation batches."""
