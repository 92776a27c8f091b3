"""Tests against a real, private Slurm cluster on this host (two slurmd daemons), run by `.ci/slurm.sh`."""
