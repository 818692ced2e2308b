"""What is taken from a model: layer selectors, forward hooks (taps), reductions, channel
layouts, layer listing, device placement.
"""
