"""``python -m nedolm_sft`` runs the CLI (handy under torchrun or without the console script)."""

from nedolm_sft.cli import main

main()
