"""A run's lifecycle around its data path: its clock (`timeline`) and the start-up and tail split read from it
(`timings`), where the host's cores went while the forwards ran (`host_use`), what it shows while it works
(`progress`), how Ctrl-C stops it (`interrupts`), and the garbage collector held off while it starts
(`startup_gc`).

Imports nothing: `offline_extract` imports `timeline` before anything else, so that the clock starts before
anything heavy (rich, through `progress`) loads.
"""
