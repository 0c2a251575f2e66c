"""Records to token batches: corpus reading and validation, tokenization and loss masks, token-budget batching."""
