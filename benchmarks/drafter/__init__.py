"""Issue 36's end-to-end check: EAGLE-3 drafters trained by SpecForge 0.2.0 on our states and on its own,
served with SGLang 0.5.17 (`pipeline.py`, its steps; README.md, the device calls)."""
