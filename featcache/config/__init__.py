"""The run's configuration: the typed spec, its one validator, YAML, the generated reference."""
