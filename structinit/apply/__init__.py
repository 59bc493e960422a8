"""``apply``: the init written into a checkpoint file, through the model the file describes.

==========================  ======================================================================
module                      what it holds
==========================  ======================================================================
``apply.options``           :class:`ApplyOptions`: what ``apply`` is asked beside the init's own
                            parameters (output, layers, position table, the fit's inputs)
``apply.files``             the checkpoint read and planned (:func:`load_for_apply`), the file
                            written (:func:`write_output`), and the names of both
``apply.models``            the model a checkpoint describes (timm, Hugging Face, a train run),
                            built with the checkpoint's weights
``apply.inputs``            the real inputs a data fit reads (a dataset, images, a tensor file)
``apply.checkpoint``        :func:`apply_checkpoint`: the init prepared on that model, written into
                            every copy of the model in the file (:func:`write_checkpoint`)
==========================  ======================================================================

The layouts it reads and writes are one table, :data:`structinit.init.layouts.LAYOUTS` (and the rows
families add): a row names a layout's tensors and the family whose adapter builds its model
(``family``, :mod:`structinit.init.family`).
"""
