"""The `jrt` command line (installed as `jrt_cli`)."""
