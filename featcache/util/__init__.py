"""Small helpers every layer may use: files, units, URLs, extras, fingerprints, plotting."""
