"""Which checkpoints exist, which one a path means, and whether they are whole: metadata, integrity, lookup."""
