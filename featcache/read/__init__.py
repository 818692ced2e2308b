"""Reading stores for training: FeatureDataset, the token view, shuffled batches, padding."""
