"""Offline extraction of EAGLE-3 training hidden states with SGLang's ModelRunner."""

__version__ = "0.1.0"
