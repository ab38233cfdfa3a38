"""The MoE layer: :mod:`.moe` (``MoELayer``: dispatch, experts, combine) and :mod:`.experts` (the experts'
grouped GEMMs over the received rows). ``moe_ep.MoELayer`` is the public name."""
