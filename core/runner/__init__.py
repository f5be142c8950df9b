"""Running: the command line, the session and run folder, model builds, checkpoints
and their checksums, and the record of failed steps."""
