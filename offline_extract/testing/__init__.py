"""The test rig, shipped for the test suites and benchmarks (as torch.testing is): seeded random checkpoints
of every supported architecture, synthetic shard directories, and residual-stream-like states."""
