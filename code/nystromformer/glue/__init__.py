"""GLUE fine-tuning: task readers, encoding, metrics, the fine-tuning loop, sweeps and submissions."""
