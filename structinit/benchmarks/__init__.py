"""Benchmarks: stand-alone measurements of one piece, each in one process: the solver recipes side
by side (:mod:`.solver`), impulse attention against a convolution (:mod:`.exactness`), the cost of
the default init's data fit in training steps (:mod:`.fit`), and train's epoch loop against a bare
PyTorch loop (:mod:`.loop`)."""
