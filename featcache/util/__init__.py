"""Small helpers every layer may use: output files, units, URLs, optional packages,
fingerprints, plotting.
"""
