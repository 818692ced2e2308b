"""What is taken from a model: selectors, hooks, reductions, layouts, layer lists, devices."""
