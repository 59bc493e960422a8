"""Training: ``TrainConfig`` and its run key, model presets, datasets, augmentation, distributed plumbing, the loop."""
