"""The installed commands (setup.cfg's console scripts): `offline-extract`, `offline-extract-inspect` and
`offline-extract-export`, one module each; bin/ holds the same commands as scripts for a checkout.

Both import this package before anything heavy (torch, SGLang), so Ctrl-C while those still import ends the
command with the shell's status for it and one line, not a traceback of the import; once the command runs,
`offline_extract.lifecycle.interrupts` takes Ctrl-C (cli._Command.invoke), so that an interrupted run cleans up.
"""

import atexit
import gc
import os
import signal

from offline_extract.lifecycle import interrupts


def _interrupted_while_starting(signum, frame) -> None:
    os.write(2, f"{interrupts.STOPPED}\n".encode())
    os._exit(interrupts.INTERRUPTED)


signal.signal(signal.SIGINT, _interrupted_while_starting)

# At exit, before the interpreter's own teardown, whose garbage collections would otherwise walk every object
# that torch, transformers and SGLang made: seconds after a run, a fraction of that frozen (docs/start-up.md).
# Nothing waits on those collections: a command's files are closed by then, and Python promises no
# finalizer at exit anyway.
atexit.register(gc.freeze)
