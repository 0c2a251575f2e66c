"""The output directory: shards, index, journals, manifest, resume, integrity checks and inspection."""
