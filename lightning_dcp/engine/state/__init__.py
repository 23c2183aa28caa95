"""What a checkpoint holds besides tensors of the model: module and optimizer state dicts, RNG states, data loaders."""
