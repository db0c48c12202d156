"""What one trial runs: model families, FFCV data pipelines, the training loop, throughput."""
