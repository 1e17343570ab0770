"""Helpers the tests share: tiny Hugging Face models of every family and tokenizers made on the
spot, and a local Slurm cluster for the launcher tests (setup_slurm.sh installs one)."""
