"""How do I train? The Trainer, its data adapters, backup and callbacks (TensorFlow imported on use)."""
