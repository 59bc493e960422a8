"""Training: ``TrainConfig`` and its run key, model presets, datasets, augmentation, distributed plumbing, the loop,
and the model of a run (or of a checkpoint) rebuilt to run real inputs through."""
