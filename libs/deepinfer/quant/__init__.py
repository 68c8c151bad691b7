"""Weight formats of the official checkpoints and the quantisation round-trips of the reference."""
