"""Looking inside the model: attention capture (zero cost when off), the head atlas and
probes, the attention formula by hand, attention vs attribution (explain), head ablation
and the cost of context.

May import every other runtime package; nothing in the runtime imports it but the public API.
"""
