"""The impulse data fit: each attention layer's Q/K refined, in order, on the inputs a batch gives
that layer at init, so that the impulse structure survives the content of real inputs.

A solve fits Q/K to position alone (the LayerNorm'd position embedding); in a model of the usual
scale the content of real inputs swamps that signal at every layer. The fit starts from the
solve, captures each layer's input on a batch as the earlier, already fitted layers make it
(:mod:`structinit.analysis.capture`), refines the layer's heads and calibrates their softness.

==========================  ======================================================================
module                      what it holds
==========================  ======================================================================
``fit.settings``            :class:`FitSettings`: the fit's parameters and algorithm versions
``fit.inputs``              what the fit runs on: a batch given, or Gaussian noise inputs of the
                            model's input shape (no data needed), with the identity of each
``fit.refine``              the loss, the Adam steps and the calibration of one layer (the maths)
``fit.layers``              the fit of a model, layer by layer (:class:`LayerFit`)
``fit.identity``            what a fit depends on (weights, inputs, settings) and its key
``fit.artifact``            the fitted artifact: found in the cache or fitted and stored
                            (:func:`load_or_fit`)
==========================  ======================================================================

The init that uses it is :class:`~structinit.init.impulse.ImpulseInit`; the fit knows nothing of
init specs: what is written between layers (the plain solve's Q/K, mimetic V/proj) comes in
through a :class:`~structinit.fit.layers.LayerWriter`.
"""
