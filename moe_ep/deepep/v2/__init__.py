"""DeepEP V2's face, :class:`moe_ep.ElasticBuffer`.

- :mod:`.buffer`: ``ElasticBuffer`` (constructor, combine)
- :mod:`.dispatch`: the dispatch calls (a base class of ``ElasticBuffer``)
- :mod:`.handle`: ``EPHandle``, what dispatch returns
- :mod:`.expand`: the expanded layout's plans (rows per expert, combine order)
- :mod:`.reduce`: the expanded combine with one rounding
- :mod:`.memory`: the memory an ``ElasticBuffer`` takes per rank
"""
