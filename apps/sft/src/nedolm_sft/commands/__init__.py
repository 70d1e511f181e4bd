"""One module per group of ``nedolm-sft`` commands; ``nedolm_sft.cli`` registers them."""
