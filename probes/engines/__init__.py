"""Engine adapters: one module per path, registered by name."""
