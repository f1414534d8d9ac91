"""Loading a model: a file or folder (:mod:`runtime.weights`) into our decoder
(:mod:`runtime.model`) on a device, with its kernels and thread governors chosen.

:class:`runtime.loader.model.Model` is what the rest of the runtime runs.
"""
