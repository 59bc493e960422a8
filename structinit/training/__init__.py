"""Training: ``TrainConfig`` and its run key, model presets, datasets, augmentation, distributed plumbing, the loop,
the run folder, and the model of a run rebuilt to run real inputs through."""
