"""DeepEP's faces: :mod:`moe_ep.deepep.v1` (``Buffer``: normal and low-latency dispatch/combine) and
:mod:`moe_ep.deepep.v2` (``ElasticBuffer``: the expanded dispatch and its combine).

The public names stay ``moe_ep.Buffer``, ``moe_ep.Config``, ``moe_ep.ElasticBuffer`` and ``moe_ep.EPHandle``.
"""
