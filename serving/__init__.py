"""Serving-level policies from the seed papers, pure Python + numpy, verified by simulation.

- ``serving.cost``: roofline cost model of a DeepSeek-V3/R1-class iteration under attention DP + MoE EP.
- ``serving.sim``: iteration-level simulator of DP ranks with in-flight batching.
- ``serving.adp``: ADP balance (routers, the per-iteration gate) and the seed-003 experiment.
- ``serving.trace``: request traces (synthetic, JSON, CSV).

Nothing here imports torch or touches a GPU; ``python -m serving --help`` lists the subcommands.
"""
