"""Slurm made to do it: Slurm client backends, the daemon, the state store, job specs,
the `slurm-ext` command line, the squeue view and the local lab cluster."""
