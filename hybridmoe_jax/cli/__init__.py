"""Command-line plumbing shared by every entry point: clean terminal output and the
progress bar (`terminal`), one-line errors (`errors`, `io_noise`), signals (`signals`) and
the one-run-per-workdir lock (`workdir_lock`). Imports only `config` (never train): the
evaluation, conversion and serving CLIs use it without pulling the trainer in."""
