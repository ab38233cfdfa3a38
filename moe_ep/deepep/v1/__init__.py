"""DeepEP V1's face, :class:`moe_ep.Buffer`.

- :mod:`.buffer`: ``Buffer`` (constructor, backend choice, normal mode)
- :mod:`.low_latency`: the low-latency calls and the rank-mask API (a base class of ``Buffer``)
- :mod:`.compat`: V1 calls that map onto the others (``internode_dispatch``, ``get_local_buffer_tensor``)
- :mod:`.config`: ``Config`` and its buffer size hints
- :mod:`.checks`: call guards shared by the communication calls
"""
