"""nedolm.train: the SFT loop and what it needs (configs, schedules, checkpoints, metrics)."""
