"""The installed commands (setup.cfg's console scripts): `offline-extract`, `offline-extract-inspect` and
`offline-extract-export`, one module each; bin/ holds the same commands as scripts for a checkout."""
