"""Engine adapters, hooks, correspondence maps and the installers that put logdiff.kernels into an engine."""
