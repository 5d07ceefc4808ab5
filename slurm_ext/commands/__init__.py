"""One module per `slurm-ext` subcommand; each defines a click command named ``command``."""
