"""Peers: what users would run instead of offline_extract, measured on the same GPU, model and corpus.

Each peer is driven through its own public entry point (SGLang's `sglang.Engine`, SpecForge's
`scripts/prepare_hidden_states.py`, an HF transformers loop); nothing here reaches into SGLang internals,
which stay in the product's adapter. `bin/bench.py --baseline NAME` runs a peer next to our extraction
and adds its row to the result's `peers` list (see `baselines.py`).
"""
