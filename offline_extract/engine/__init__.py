"""The model side: SGLang's ModelRunner behind one adapter, host offload, torchrun coordination, HF parity, NaN/Inf policy."""
